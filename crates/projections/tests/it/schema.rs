//! The content marking of the stored schema: every string field of package
//! `anima.v1` that can be stored says explicitly whether it can carry user content,
//! `(anima.v1.content) = true` or `false`. Analytics redaction is derived from that marking, so a
//! field left unmarked fails here with its full name.
//!
//! The stored schema is every `anima.v1` message of `events.proto` and every message an
//! `Envelope` can contain, whichever file defines it. (The descriptor set may also hold the API's
//! messages; they are not stored and not checked here.)

use std::collections::BTreeSet;

use anima_projections::proto::EVENTS_DESCRIPTOR_SET;
use prost::Message;
use prost_reflect::{DescriptorPool, DynamicMessage, ExtensionDescriptor, FieldDescriptor, Kind, Value};

const PACKAGE: &str = "anima.v1";
const CONTENT_OPTION: &str = "anima.v1.content";
const STORED_SCHEMA_FILE: &str = "anima/v1/events.proto";
const STORED_ROOT: &str = "anima.v1.Envelope";

/// Full names of the messages that can be stored: those of the stored schema's file, and every
/// message reachable from the envelope.
fn stored_messages(pool: &DescriptorPool) -> BTreeSet<String> {
    let mut stored: BTreeSet<String> = pool
        .all_messages()
        .filter(|m| m.parent_file().name() == STORED_SCHEMA_FILE)
        .map(|m| m.full_name().to_owned())
        .collect();
    let mut pending = vec![pool.get_message_by_name(STORED_ROOT).expect("the stored schema has an Envelope")];
    while let Some(message) = pending.pop() {
        stored.insert(message.full_name().to_owned());
        for field in message.fields() {
            if let Kind::Message(inner) = field.kind() {
                if !stored.contains(inner.full_name()) {
                    pending.push(inner);
                }
            }
        }
    }
    stored
}

/// Whether a field holds strings: a string, a repeated string, or a map with string keys or values.
fn holds_strings(field: &FieldDescriptor) -> bool {
    match field.kind() {
        Kind::String => true,
        Kind::Message(entry) if field.is_map() => {
            entry.map_entry_key_field().kind() == Kind::String || entry.map_entry_value_field().kind() == Kind::String
        }
        _ => false,
    }
}

/// The string fields of `messages` (in `anima.v1`) with their marking: `None` when unmarked.
fn content_marking(pool: &DescriptorPool, messages: &BTreeSet<String>) -> Vec<(String, Option<bool>)> {
    let content: ExtensionDescriptor = pool
        .get_extension_by_name(CONTENT_OPTION)
        .unwrap_or_else(|| panic!("the schema defines no {CONTENT_OPTION} option"));
    let mut marking = Vec::new();
    for message in pool.all_messages() {
        if message.package_name() != PACKAGE || message.is_map_entry() || !messages.contains(message.full_name()) {
            continue;
        }
        for field in message.fields() {
            if !holds_strings(&field) {
                continue;
            }
            let options = field.options();
            let marked = options.has_extension(&content).then(|| match options.get_extension(&content).as_ref() {
                Value::Bool(b) => *b,
                other => panic!("{CONTENT_OPTION} of {} is not a bool: {other:?}", field.full_name()),
            });
            marking.push((field.full_name().to_owned(), marked));
        }
    }
    marking
}

fn stored_marking(pool: &DescriptorPool) -> Vec<(String, Option<bool>)> {
    content_marking(pool, &stored_messages(pool))
}

fn unmarked(marking: &[(String, Option<bool>)]) -> Vec<&str> {
    marking.iter().filter(|(_, marked)| marked.is_none()).map(|(name, _)| name.as_str()).collect()
}

fn events_pool() -> DescriptorPool {
    DescriptorPool::decode(EVENTS_DESCRIPTOR_SET).expect("the events descriptor set decodes")
}

#[test]
fn every_string_field_is_marked_either_way() {
    let marking = stored_marking(&events_pool());
    assert!(marking.len() > 20, "found only {} string fields; is the descriptor set complete?", marking.len());
    assert!(
        marking.iter().any(|(_, marked)| marked.is_some()),
        "no string field carries {CONTENT_OPTION} at all: the descriptor set lost its extension options \
         (encode it with protox::Compiler::encode_file_descriptor_set, not through prost-types)"
    );
    assert_eq!(unmarked(&marking), Vec::<&str>::new(), "string fields without an explicit (anima.v1.content) marking");
}

#[test]
fn user_content_fields_are_marked_as_content() {
    let marking = stored_marking(&events_pool());
    let content: Vec<&str> =
        marking.iter().filter(|(_, marked)| *marked == Some(true)).map(|(name, _)| name.as_str()).collect();
    for field in [
        "anima.v1.SlackMessageObserved.text",
        "anima.v1.SlackMessageObserved.user_name",
        "anima.v1.SlackFile.name",
        "anima.v1.SendConfirmed.text",
        "anima.v1.WakeFinishRequested.reason",
        "anima.v1.AgentRegistered.display_name",
    ] {
        assert!(content.contains(&field), "{field} carries user content but is not marked as content");
    }
}

#[test]
fn a_send_request_has_no_field_that_could_hold_the_draft() {
    let pool = events_pool();
    let send = pool.get_message_by_name("anima.v1.SendRequested").expect("SendRequested exists");
    let marking = stored_marking(&pool);
    for field in send.fields() {
        let name = field.full_name();
        if let Some((_, marked)) = marking.iter().find(|(n, _)| n == name) {
            assert_eq!(*marked, Some(false), "{name} could carry the draft; the draft is never stored");
        }
    }
}

/// The check itself works: a schema with an unmarked string field (and a repeated one, and a
/// map) is reported by full name, while marked fields and non-string fields are not. The test
/// file is added to the stored set with the option set through reflection, independently of how
/// the build encoded the set.
#[test]
fn an_unmarked_field_is_reported_by_its_full_name() {
    use prost_types::field_descriptor_proto::{Label, Type};
    use prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorProto, MessageOptions};

    let field = |name: &str, number: i32, label: Label, kind: Type, type_name: Option<&str>| FieldDescriptorProto {
        name: Some(name.to_owned()),
        number: Some(number),
        label: Some(label as i32),
        r#type: Some(kind as i32),
        type_name: type_name.map(str::to_owned),
        json_name: Some(name.to_owned()),
        ..Default::default()
    };
    let entry = DescriptorProto {
        name: Some("LabelsEntry".to_owned()),
        field: vec![
            field("key", 1, Label::Optional, Type::String, None),
            field("value", 2, Label::Optional, Type::String, None),
        ],
        options: Some(MessageOptions { map_entry: Some(true), ..Default::default() }),
        ..Default::default()
    };
    let file = FileDescriptorProto {
        name: Some("anima/v1/unmarked_test.proto".to_owned()),
        package: Some(PACKAGE.to_owned()),
        dependency: vec!["anima/v1/options.proto".to_owned()],
        syntax: Some("proto3".to_owned()),
        message_type: vec![DescriptorProto {
            name: Some("Unmarked".to_owned()),
            field: vec![
                field("marked_content", 1, Label::Optional, Type::String, None),
                field("marked_plain", 2, Label::Optional, Type::String, None),
                field("note", 3, Label::Optional, Type::String, None),
                field("tags", 4, Label::Repeated, Type::String, None),
                field("count", 5, Label::Optional, Type::Uint64, None),
                field("labels", 6, Label::Repeated, Type::Message, Some(".anima.v1.Unmarked.LabelsEntry")),
            ],
            nested_type: vec![entry],
            ..Default::default()
        }],
        ..Default::default()
    };

    // Mark two fields, either way, through reflection (prost-types would drop the extension).
    let base = events_pool();
    let content = base.get_extension_by_name(CONTENT_OPTION).expect("the option exists");
    let file_type =
        base.get_message_by_name("google.protobuf.FileDescriptorProto").expect("descriptor.proto is imported");
    let options_type = base.get_message_by_name("google.protobuf.FieldOptions").expect("descriptor.proto is imported");
    let mut file = DynamicMessage::decode(file_type, file.encode_to_vec().as_slice()).unwrap();
    let Some(Value::List(messages)) = file.get_field_by_name_mut("message_type") else { unreachable!() };
    let Some(Value::Message(message)) = messages.first_mut() else { unreachable!() };
    let Some(Value::List(fields)) = message.get_field_by_name_mut("field") else { unreachable!() };
    for (index, marked) in [(0, true), (1, false)] {
        let Value::Message(field) = &mut fields[index] else { unreachable!() };
        let mut options = DynamicMessage::new(options_type.clone());
        options.set_extension(&content, Value::Bool(marked));
        field.set_field_by_name("options", Value::Message(options));
    }

    // A FileDescriptorSet is a repeated field 1: appending one more encoded file extends it.
    let mut set = EVENTS_DESCRIPTOR_SET.to_vec();
    let file = file.encode_to_vec();
    prost::encoding::encode_key(1, prost::encoding::WireType::LengthDelimited, &mut set);
    prost::encoding::encode_varint(file.len() as u64, &mut set);
    set.extend(file);
    let pool = DescriptorPool::decode(set.as_slice()).expect("the extended set is valid");

    let marking: Vec<(String, Option<bool>)> =
        content_marking(&pool, &BTreeSet::from(["anima.v1.Unmarked".to_owned()]));
    let expected = [
        ("anima.v1.Unmarked.marked_content", Some(true)),
        ("anima.v1.Unmarked.marked_plain", Some(false)),
        ("anima.v1.Unmarked.note", None),
        ("anima.v1.Unmarked.tags", None),
        ("anima.v1.Unmarked.labels", None),
    ];
    assert_eq!(marking, expected.map(|(name, marked)| (name.to_owned(), marked)));
    assert_eq!(unmarked(&marking), ["anima.v1.Unmarked.note", "anima.v1.Unmarked.tags", "anima.v1.Unmarked.labels"]);
}
