//! `--json`: the replay tool's answers for scripts. `state` and `explain` print one JSON document
//! each: the API's answer as protobuf JSON (proto field names, scalar and list fields present at
//! their defaults, 64-bit integers as numbers, enums by name), with an RFC 3339 time beside every
//! log time in nanoseconds (`log_time` beside `log_time_ns`) and the recorded verdict as a JSON
//! value rather than a string holding JSON. `timeline` prints the JSON lines of `export`, and
//! `verify` its report as one document. Nothing here formats Rust values with `Debug`: every
//! field comes from the API's own messages.
use std::sync::OnceLock;

use anima_projections::proto::EVENTS_DESCRIPTOR_SET;
use anyhow::Context;
use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use serde_json::{Map, Value};

use super::format_time_ns;

/// The suffix of every field holding a log time in unix nanoseconds.
const LOG_TIME_NS_SUFFIX: &str = "log_time_ns";

/// Fields holding the fold's verdict as JSON text.
const VERDICT_FIELDS: [&str; 1] = ["verdict"];

fn descriptor_pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| DescriptorPool::decode(EVENTS_DESCRIPTOR_SET).expect("the built-in descriptor set decodes"))
}

/// One API message (`name` is its full protobuf name, e.g. `anima.v1.ReplayStateAtResponse`) as
/// the JSON document `--json` prints: scalar and list fields always present (at their defaults
/// when unset), a nested message only when set.
pub fn message_document<M: prost::Message>(message: &M, name: &str) -> anyhow::Result<Value> {
    let descriptor =
        descriptor_pool().get_message_by_name(name).with_context(|| format!("no message {name} in the schema"))?;
    let dynamic = DynamicMessage::decode(descriptor, message.encode_to_vec().as_slice())
        .with_context(|| format!("re-reading {name}"))?;
    let options =
        SerializeOptions::new().use_proto_field_name(true).stringify_64_bit_integers(false).skip_default_fields(false);
    let mut document = dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .with_context(|| format!("{name} as JSON"))?;
    enrich(&mut document);
    Ok(document)
}

/// Adds an RFC 3339 time beside every log time in nanoseconds and turns verdict strings into
/// JSON values (`null` when empty), at every depth.
fn enrich(value: &mut Value) {
    match value {
        Value::Object(fields) => {
            let times: Vec<(String, String)> = fields
                .iter()
                .filter(|(key, _)| key.ends_with(LOG_TIME_NS_SUFFIX))
                .filter_map(|(key, value)| {
                    let ns = value.as_i64()?;
                    Some((key.trim_end_matches("_ns").to_owned(), format_time_ns(ns)))
                })
                .collect();
            for (key, time) in times {
                fields.insert(key, Value::String(time));
            }
            for field in VERDICT_FIELDS {
                parse_verdict(fields, field);
            }
            for inner in fields.values_mut() {
                enrich(inner);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(enrich),
        _ => {}
    }
}

fn parse_verdict(fields: &mut Map<String, Value>, field: &str) {
    if let Some(Value::String(text)) = fields.get(field) {
        let parsed = if text.is_empty() { Some(Value::Null) } else { serde_json::from_str(text).ok() };
        if let Some(parsed) = parsed {
            fields.insert(field.to_owned(), parsed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api;

    #[test]
    fn state_documents_carry_rfc3339_times_and_their_defaults() {
        let state = api::ReplayStateAtResponse {
            as_of_seq: 7,
            as_of_log_time_ns: 1_700_000_000_500_000_000,
            agent: Some(api::ReplayAgentState {
                agent_id: "ada_bot".into(),
                queued: vec![api::ReplayWakeItem {
                    item_id: "i1".into(),
                    queued_log_time_ns: 1_700_000_001_000_000_000,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let document = message_document(&state, "anima.v1.ReplayStateAtResponse").expect("a document");
        assert_eq!(document["as_of_seq"], 7);
        assert_eq!(document["as_of_log_time_ns"], 1_700_000_000_500_000_000_i64);
        assert_eq!(document["as_of_log_time"], "2023-11-14T22:13:20.500Z");
        assert_eq!(document["agent"]["agent_id"], "ada_bot");
        assert_eq!(document["agent"]["queued"][0]["queued_log_time"], "2023-11-14T22:13:21.000Z");
        // Scalars and lists are present at their defaults, so scripts need no "missing means
        // zero" rule; a part that does not apply (no surface was asked for) is absent.
        assert_eq!(document["halted"], "");
        assert_eq!(document["agent"]["cursors"], Value::Array(Vec::new()));
        assert_eq!(document["agent"]["registered"], false);
        assert_eq!(document.get("surface"), None, "{document}");
    }

    #[test]
    fn verdicts_are_json_values() {
        let explanation = api::ReplayExplainResponse {
            seq: 3,
            verdict: r#"{"Send":{"Held":{"new_messages":1}}}"#.into(),
            ..Default::default()
        };
        let document = message_document(&explanation, "anima.v1.ReplayExplainResponse").expect("a document");
        assert_eq!(document["verdict"]["Send"]["Held"]["new_messages"], 1);
        let none = api::ReplayExplainResponse { seq: 3, ..Default::default() };
        let document = message_document(&none, "anima.v1.ReplayExplainResponse").expect("a document");
        assert_eq!(document["verdict"], Value::Null);
    }
}
