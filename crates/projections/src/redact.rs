//! The redacted, content-free view of stored events, and the pure counters
//! analytics computes from it.
//!
//! What is content is not decided here: it is read from the `(anima.v1.content)` marking of the
//! stored schema (`events.proto`, in [`crate::proto::EVENTS_DESCRIPTOR_SET`]). A string field is
//! kept only when the schema marks it `(anima.v1.content) = false` (ids, ts, subtypes); every
//! other string — marked content, or unmarked — is reduced to its size in bytes. Bytes fields and
//! maps are reduced to sizes and lengths. The view is walked from the schema itself, so an event
//! kind added to `events.proto` is redacted without touching this file, and an unmarked field
//! fails safe (and fails the schema test).
//!
//! [`RedactedEvent`] therefore has no field that can hold content: its strings are the event
//! type, the subject (encoded ids), the event id and source (both marked non-content), field
//! paths, enum names and [`RedactedValue::Id`]s. The fold's verdict for an event is reduced the
//! same way ([`RedactedOutcome`]): kinds, reasons, counts — never a refusal's prose.
//!
//! [`AnalyticsCounts`] folds redacted events (with outcomes) into counts and byte sums by event
//! type and time bucket, and the derived figures: send hold rate, wakes by reason, settles
//! without a turn, finishes by outcome, refusals by kind, reply placement in DMs.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, Value};
use serde::{Deserialize, Serialize};

use crate::verdict::{ClaimVerdict, RefusalKind, SendVerdict, Verdict};
use crate::wake::NotQueued;

/// The field option that marks content.
pub const CONTENT_OPTION: &str = "anima.v1.content";
/// The stored event's message.
pub const ENVELOPE_MESSAGE: &str = "anima.v1.Envelope";
/// The envelope's oneof whose set field names the event type.
pub const PAYLOAD_ONEOF: &str = "payload";
/// Fields one redacted event lists at most; the rest are dropped and `fields_truncated` is set.
pub const REDACTED_FIELDS_MAX: usize = 256;
/// Elements of one repeated field walked at most (its length is always counted exactly).
pub const REDACTED_LIST_ELEMENTS_MAX: usize = 32;
/// Nesting walked at most; deeper messages are counted, not walked.
pub const REDACTED_DEPTH_MAX: usize = 8;
/// Time buckets one [`AnalyticsCounts`] keeps at most; events in further buckets still count in
/// the totals, and `buckets_truncated` is set.
pub const ANALYTICS_BUCKETS_MAX: usize = 100_000;

/// Event type of a payload this schema does not know (written by a newer engine).
pub const EVENT_TYPE_UNKNOWN: &str = "unknown";
/// Event type of stored bytes that are not an envelope.
pub const EVENT_TYPE_UNDECODABLE: &str = "undecodable";
/// Event type of an envelope without a payload.
pub const EVENT_TYPE_EMPTY: &str = "empty";

/// The schema cannot be used for redaction. A build or programmer error: fix the schema.
#[derive(Debug, thiserror::Error)]
pub enum RedactionSchemaError {
    #[error("descriptor set does not decode: {0}")]
    Descriptors(String),
    #[error("the schema has no {0}")]
    Missing(&'static str),
}

/// Derives redacted views from the content marking of one schema.
#[derive(Clone, Debug)]
pub struct Redactor {
    envelope: MessageDescriptor,
    /// Full names of string fields marked `(anima.v1.content) = false`. Every other string
    /// field is content.
    plain: BTreeSet<String>,
    /// Field number of each payload variant of the envelope → its name (the event type).
    payload_names: BTreeMap<u32, String>,
    /// Every message of the schema as the wire walk counts it ([`Redactor::redact_counted`]),
    /// by position; the envelope's is `wire_envelope`.
    wire: Vec<WireMessage>,
    wire_envelope: usize,
}

/// A message of the schema as the wire walk counts it: its fields by number.
#[derive(Clone, Debug)]
struct WireMessage {
    fields: Vec<(u32, WireField)>,
    /// False for a message the walk leaves to the full view: one with a map field (a map's keys
    /// count as content whatever their marking), or too many fields or oneofs to track.
    walkable: bool,
}

#[derive(Clone, Copy, Debug)]
struct WireField {
    count: WireCount,
    /// Repeated: may appear any number of times. Others may appear once.
    repeated: bool,
    /// Position of the oneof it is a member of, in its message.
    oneof: Option<u8>,
}

#[derive(Clone, Copy, Debug)]
enum WireCount {
    /// Numbers, flags and enums: no content.
    Nothing,
    /// A string marked non-content.
    Plain,
    /// A content string or bytes: its length.
    Content,
    /// A message, by position in [`Redactor::wire`].
    Message(usize),
}

/// Fields and oneofs of one message the walk can track (bits of a `u128` and a `u64`).
const WIRE_FIELDS_MAX: usize = 128;
const WIRE_ONEOFS_MAX: usize = 64;

fn wire_messages(pool: &DescriptorPool, plain: &BTreeSet<String>) -> Vec<WireMessage> {
    let messages: Vec<MessageDescriptor> = pool.all_messages().collect();
    let position: BTreeMap<String, usize> =
        messages.iter().enumerate().map(|(i, message)| (message.full_name().to_owned(), i)).collect();
    messages
        .iter()
        .map(|message| {
            let oneofs: Vec<String> = message.oneofs().map(|oneof| oneof.full_name().to_owned()).collect();
            let mut fields: Vec<(u32, WireField)> = message
                .fields()
                .map(|field| {
                    let count = match field.kind() {
                        Kind::String if plain.contains(field.full_name()) => WireCount::Plain,
                        Kind::String | Kind::Bytes => WireCount::Content,
                        Kind::Message(inner) => WireCount::Message(position[inner.full_name()]),
                        _ => WireCount::Nothing,
                    };
                    let oneof = field
                        .containing_oneof()
                        .and_then(|oneof| oneofs.iter().position(|name| name == oneof.full_name()))
                        .and_then(|p| u8::try_from(p).ok());
                    (field.number(), WireField { count, repeated: field.is_list(), oneof })
                })
                .collect();
            fields.sort_by_key(|(number, _)| *number);
            let walkable = fields.len() <= WIRE_FIELDS_MAX
                && oneofs.len() <= WIRE_ONEOFS_MAX
                && !message.fields().any(|field| field.is_map());
            WireMessage { fields, walkable }
        })
        .collect()
}

/// One stored event without its content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RedactedEvent {
    pub seq: u64,
    /// The log's time of the event, unix ns.
    pub log_time_ns: i64,
    /// The subject it was stored on: family and encoded ids, never content.
    pub subject: String,
    /// The payload's field name in `Envelope` ("slack_message", "send", ...), or
    /// [`EVENT_TYPE_UNKNOWN`], [`EVENT_TYPE_UNDECODABLE`], [`EVENT_TYPE_EMPTY`].
    pub event_type: String,
    pub event_id: String,
    pub source: String,
    pub occurred_at_ms: i64,
    pub min_reader_version: u32,
    /// Size of the stored event.
    pub event_bytes: u64,
    /// Bytes of every content string in it (counted, never kept).
    pub content_bytes: u64,
    /// Every set field of the payload by path, in schema order.
    pub fields: Vec<RedactedField>,
    pub fields_truncated: bool,
    /// What the fold decided for it, when known.
    pub outcome: Option<RedactedOutcome>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RedactedField {
    /// Dotted path from the payload, with indexes for repeated fields: `target.slack.channel_id`,
    /// `files[0].size_bytes`. Fields outside the payload start with `envelope.`.
    pub path: String,
    pub value: RedactedValue,
}

/// A field's value as analytics may see it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum RedactedValue {
    Flag(bool),
    Int(i64),
    Uint(u64),
    Number(f64),
    /// An enum value's name (its number when the schema lacks it).
    Enum(String),
    /// A string the schema marks as non-content.
    Id(String),
    /// A content string: its size in bytes.
    ContentBytes(u64),
    /// A bytes field: its size.
    Bytes(u64),
    /// A repeated or map field: its length.
    Count(u64),
}

impl Redactor {
    /// A redactor for the schema in an encoded `FileDescriptorSet` that keeps extension options.
    pub fn new(descriptor_set: &[u8]) -> Result<Redactor, RedactionSchemaError> {
        let pool =
            DescriptorPool::decode(descriptor_set).map_err(|e| RedactionSchemaError::Descriptors(e.to_string()))?;
        let envelope =
            pool.get_message_by_name(ENVELOPE_MESSAGE).ok_or(RedactionSchemaError::Missing("anima.v1.Envelope"))?;
        let content =
            pool.get_extension_by_name(CONTENT_OPTION).ok_or(RedactionSchemaError::Missing("(anima.v1.content)"))?;
        let mut plain = BTreeSet::new();
        for message in pool.all_messages() {
            for field in message.fields() {
                let options = field.options();
                let marked_plain = options.has_extension(&content)
                    && matches!(options.get_extension(&content).as_ref(), Value::Bool(false));
                if marked_plain {
                    plain.insert(field.full_name().to_owned());
                }
            }
        }
        let payload_names = envelope
            .fields()
            .filter(|field| field.containing_oneof().is_some_and(|oneof| oneof.name() == PAYLOAD_ONEOF))
            .map(|field| (field.number(), field.name().to_owned()))
            .collect();
        let wire = wire_messages(&pool, &plain);
        let wire_envelope = pool
            .all_messages()
            .position(|message| message.full_name() == ENVELOPE_MESSAGE)
            .ok_or(RedactionSchemaError::Missing("anima.v1.Envelope"))?;
        Ok(Redactor { envelope, plain, payload_names, wire, wire_envelope })
    }

    /// The redactor of the schema this crate was built with.
    pub fn schema() -> &'static Redactor {
        static SCHEMA: OnceLock<Redactor> = OnceLock::new();
        SCHEMA.get_or_init(|| {
            Redactor::new(crate::proto::EVENTS_DESCRIPTOR_SET)
                .expect("the built-in descriptor set has the stored schema")
        })
    }

    /// Whether a string field may be kept: the schema marks it explicitly as non-content.
    pub fn is_plain(&self, field: &FieldDescriptor) -> bool {
        self.plain.contains(field.full_name())
    }

    /// The event type of stored bytes (see [`RedactedEvent::event_type`]).
    pub fn event_type(&self, stored: &[u8]) -> String {
        match DynamicMessage::decode(self.envelope.clone(), stored) {
            Ok(envelope) => self.payload_type(&envelope),
            Err(_) => EVENT_TYPE_UNDECODABLE.to_owned(),
        }
    }

    /// The event type of stored bytes like [`Redactor::event_type`], found from the envelope's
    /// top-level field numbers without decoding it: cheap enough for every publish (the log puts
    /// it in a message header so NATS tools filter without decoding).
    pub fn stored_event_type(&self, stored: &[u8]) -> &str {
        let mut buf = stored;
        let mut found = None;
        let mut unknown = false;
        while !buf.is_empty() {
            let Ok((number, wire_type)) = prost::encoding::decode_key(&mut buf) else {
                return EVENT_TYPE_UNDECODABLE;
            };
            match self.payload_names.get(&number) {
                // A oneof's last variant on the wire wins, as in a full decode.
                Some(name) => found = Some(name.as_str()),
                // The wire plan's fields by number: no descriptor is built per field.
                None => {
                    let envelope_fields = &self.wire[self.wire_envelope].fields;
                    unknown |= envelope_fields.binary_search_by_key(&number, |(number, _)| *number).is_err();
                }
            }
            let skipped =
                prost::encoding::skip_field(wire_type, number, &mut buf, prost::encoding::DecodeContext::default());
            if skipped.is_err() {
                return EVENT_TYPE_UNDECODABLE;
            }
        }
        match found {
            Some(name) => name,
            None if unknown => EVENT_TYPE_UNKNOWN,
            None => EVENT_TYPE_EMPTY,
        }
    }

    /// The redacted view as the maintained analytics count it (type, sizes, envelope fields),
    /// for an event the fold decoded as `envelope`: without a dynamic decode of it, which was
    /// most of the runner's work per event. Its `fields` are exactly the [`FIGURE_FIELDS`] of
    /// its type that are set, taken from the typed decode, in the full view's order. An
    /// encoding the wire walk does not judge the way a decode would (a field that may appear
    /// once appearing twice, two members of a oneof, a map, nesting past
    /// [`REDACTED_DEPTH_MAX`]) gets the full [`Redactor::redact`]. Counting the full view and
    /// this one gives the same counts.
    pub fn redact_counted(
        &self,
        seq: u64,
        log_time_ns: i64,
        subject: &str,
        stored: &[u8],
        envelope: &crate::proto::Envelope,
    ) -> RedactedEvent {
        let Some(content_bytes) = self.wire_content_bytes(self.wire_envelope, stored, 0) else {
            return self.redact(seq, log_time_ns, subject, stored);
        };
        RedactedEvent {
            seq,
            log_time_ns,
            subject: subject.to_owned(),
            event_type: self.stored_event_type(stored).to_owned(),
            event_id: envelope.event_id.clone(),
            source: envelope.source.clone(),
            occurred_at_ms: envelope.occurred_at_ms,
            min_reader_version: envelope.min_reader_version,
            event_bytes: stored.len() as u64,
            content_bytes,
            fields: figure_fields(envelope),
            fields_truncated: false,
            outcome: None,
        }
    }

    /// The content bytes of the encoding of message `message` (a position in
    /// [`Redactor::wire`]), walked on the wire: what [`Redactor::redact`] counts for bytes a
    /// decode accepts, or `None` where the two could differ (see [`Redactor::redact_counted`]).
    /// Unknown fields count nothing, as there.
    fn wire_content_bytes(&self, message: usize, mut buf: &[u8], depth: usize) -> Option<u64> {
        use prost::encoding::{decode_key, decode_varint, skip_field, DecodeContext, WireType};
        let plan = &self.wire[message];
        if depth >= REDACTED_DEPTH_MAX || !plan.walkable {
            return None;
        }
        let mut total = 0u64;
        let (mut fields_seen, mut oneofs_seen) = (0u128, 0u64);
        while !buf.is_empty() {
            let (number, wire_type) = decode_key(&mut buf).ok()?;
            let Ok(position) = plan.fields.binary_search_by_key(&number, |(number, _)| *number) else {
                skip_field(wire_type, number, &mut buf, DecodeContext::default()).ok()?;
                continue;
            };
            let field = plan.fields[position].1;
            if !field.repeated {
                let bit = 1u128 << position;
                if fields_seen & bit != 0 {
                    return None;
                }
                fields_seen |= bit;
                if let Some(oneof) = field.oneof {
                    let bit = 1u64 << oneof;
                    if oneofs_seen & bit != 0 {
                        return None;
                    }
                    oneofs_seen |= bit;
                }
            }
            if matches!(field.count, WireCount::Nothing) {
                skip_field(wire_type, number, &mut buf, DecodeContext::default()).ok()?;
                continue;
            }
            if wire_type != WireType::LengthDelimited {
                return None;
            }
            let len = usize::try_from(decode_varint(&mut buf).ok()?).ok()?;
            if len > buf.len() {
                return None;
            }
            let (value, rest) = buf.split_at(len);
            buf = rest;
            total += match field.count {
                WireCount::Nothing | WireCount::Plain => 0,
                WireCount::Content => len as u64,
                WireCount::Message(inner) => self.wire_content_bytes(inner, value, depth + 1)?,
            };
        }
        Some(total)
    }

    fn payload_type(&self, envelope: &DynamicMessage) -> String {
        let payload = envelope
            .fields()
            .find(|(field, _)| field.containing_oneof().is_some_and(|oneof| oneof.name() == PAYLOAD_ONEOF));
        match payload {
            Some((field, _)) => field.name().to_owned(),
            None if envelope.unknown_fields().next().is_some() => EVENT_TYPE_UNKNOWN.to_owned(),
            None => EVENT_TYPE_EMPTY.to_owned(),
        }
    }

    /// The redacted view of one stored event. Never fails: bytes that do not decode give an
    /// event of type [`EVENT_TYPE_UNDECODABLE`] with sizes only.
    pub fn redact(&self, seq: u64, log_time_ns: i64, subject: &str, stored: &[u8]) -> RedactedEvent {
        let mut event = RedactedEvent {
            seq,
            log_time_ns,
            subject: subject.to_owned(),
            event_type: EVENT_TYPE_UNDECODABLE.to_owned(),
            event_id: String::new(),
            source: String::new(),
            occurred_at_ms: 0,
            min_reader_version: 0,
            event_bytes: stored.len() as u64,
            content_bytes: 0,
            fields: Vec::new(),
            fields_truncated: false,
            outcome: None,
        };
        let Ok(envelope) = DynamicMessage::decode(self.envelope.clone(), stored) else {
            return event;
        };
        event.event_type = self.payload_type(&envelope);
        let mut walk = Walk { redactor: self, event: &mut event };
        for (field, value) in envelope.fields() {
            let in_payload = field.containing_oneof().is_some_and(|oneof| oneof.name() == PAYLOAD_ONEOF);
            match (field.name(), value) {
                (_, Value::Message(payload)) if in_payload => walk.message(payload, "", 0),
                ("event_id", Value::String(id)) if walk.redactor.is_plain(&field) => walk.event.event_id = id.clone(),
                ("source", Value::String(source)) if walk.redactor.is_plain(&field) => {
                    walk.event.source = source.clone()
                }
                ("occurred_at_ms", Value::I64(ms)) => walk.event.occurred_at_ms = *ms,
                ("min_reader_version", Value::U32(version)) => walk.event.min_reader_version = *version,
                _ => walk.field(&field, value, "envelope.", 0),
            }
        }
        event
    }
}

/// One walk over a decoded event, filling `event`.
struct Walk<'a> {
    redactor: &'a Redactor,
    event: &'a mut RedactedEvent,
}

impl Walk<'_> {
    fn push(&mut self, path: String, value: RedactedValue) {
        if self.event.fields.len() < REDACTED_FIELDS_MAX {
            self.event.fields.push(RedactedField { path, value });
        } else {
            self.event.fields_truncated = true;
        }
    }

    fn message(&mut self, message: &DynamicMessage, prefix: &str, depth: usize) {
        for (field, value) in message.fields() {
            self.field(&field, value, prefix, depth);
        }
        // Fields of a newer schema: their content is unknown, so only their presence counts.
        let unknown = message.unknown_fields().count();
        if unknown > 0 {
            self.push(format!("{prefix}unknown_fields"), RedactedValue::Count(unknown as u64));
        }
    }

    fn field(&mut self, field: &FieldDescriptor, value: &Value, prefix: &str, depth: usize) {
        let path = format!("{prefix}{}", field.name());
        match value {
            Value::List(items) => {
                self.push(path.clone(), RedactedValue::Count(items.len() as u64));
                for (index, item) in items.iter().enumerate() {
                    if index < REDACTED_LIST_ELEMENTS_MAX {
                        self.value(field, item, format!("{path}[{index}]"), depth);
                    } else {
                        // Not listed, but its content still counts.
                        self.event.content_bytes += self.content_size(field, item, depth);
                    }
                }
            }
            Value::Map(entries) => {
                self.push(path, RedactedValue::Count(entries.len() as u64));
                let sizes: u64 = entries
                    .iter()
                    .map(|(key, value)| {
                        let key = match key {
                            prost_reflect::MapKey::String(s) => s.len() as u64,
                            _ => 0,
                        };
                        key + self.content_size(field, value, depth)
                    })
                    .sum();
                self.event.content_bytes += sizes;
            }
            single => self.value(field, single, path, depth),
        }
    }

    fn value(&mut self, field: &FieldDescriptor, value: &Value, path: String, depth: usize) {
        let redacted = match value {
            Value::Bool(b) => RedactedValue::Flag(*b),
            Value::I32(n) => RedactedValue::Int(i64::from(*n)),
            Value::I64(n) => RedactedValue::Int(*n),
            Value::U32(n) => RedactedValue::Uint(u64::from(*n)),
            Value::U64(n) => RedactedValue::Uint(*n),
            Value::F32(n) => RedactedValue::Number(f64::from(*n)),
            Value::F64(n) => RedactedValue::Number(*n),
            Value::EnumNumber(number) => RedactedValue::Enum(enum_name(field, *number)),
            Value::String(s) if self.redactor.is_plain(field) => RedactedValue::Id(s.clone()),
            Value::String(s) => {
                self.event.content_bytes += s.len() as u64;
                RedactedValue::ContentBytes(s.len() as u64)
            }
            Value::Bytes(b) => {
                self.event.content_bytes += b.len() as u64;
                RedactedValue::Bytes(b.len() as u64)
            }
            Value::Message(inner) if depth < REDACTED_DEPTH_MAX => {
                self.message(inner, &format!("{path}."), depth + 1);
                return;
            }
            Value::Message(inner) => {
                self.event.content_bytes += self.content_size(field, &Value::Message(inner.clone()), depth);
                RedactedValue::Count(inner.fields().count() as u64)
            }
            Value::List(_) | Value::Map(_) => {
                self.event.content_bytes += self.content_size(field, value, depth);
                RedactedValue::Count(0)
            }
        };
        self.push(path, redacted);
    }

    /// Content bytes inside a value that is not listed.
    fn content_size(&self, field: &FieldDescriptor, value: &Value, depth: usize) -> u64 {
        match value {
            Value::String(s) if !self.redactor.is_plain(field) => s.len() as u64,
            Value::Bytes(b) => b.len() as u64,
            Value::List(items) => items.iter().map(|item| self.content_size(field, item, depth)).sum(),
            Value::Map(entries) => entries.values().map(|item| self.content_size(field, item, depth)).sum(),
            Value::Message(inner) if depth < 4 * REDACTED_DEPTH_MAX => {
                inner.fields().map(|(inner_field, item)| self.content_size(&inner_field, item, depth + 1)).sum()
            }
            _ => 0,
        }
    }
}

fn enum_name(field: &FieldDescriptor, number: i32) -> String {
    match field.kind() {
        Kind::Enum(descriptor) => match descriptor.get_value(number) {
            Some(value) => value.name().to_owned(),
            None => number.to_string(),
        },
        _ => number.to_string(),
    }
}

impl RedactedEvent {
    /// The value at `path`, if set.
    pub fn field(&self, path: &str) -> Option<&RedactedValue> {
        self.fields.iter().find(|f| f.path == path).map(|f| &f.value)
    }

    /// The non-content string at `path`, if set.
    pub fn id(&self, path: &str) -> Option<&str> {
        match self.field(path) {
            Some(RedactedValue::Id(id)) => Some(id),
            _ => None,
        }
    }

    /// Whether the payload names `agent` in an agent id field (`agent_id`, `receiving_agent_id`,
    /// at any depth).
    pub fn names_agent(&self, agent: &str) -> bool {
        self.fields.iter().any(|f| {
            let name = f.path.rsplit('.').next().unwrap_or(&f.path);
            name.ends_with("agent_id") && matches!(&f.value, RedactedValue::Id(id) if id == agent)
        })
    }
}

/// The fold's verdict for one event, without prose: kinds, reasons and counts.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedactedOutcome {
    /// "journaled", "not_journaled", "agent_registered", "send_allowed", "send_held", "claimed",
    /// "claimed_nothing", "started", "finished", "requeued", "refused", or the snake-case name of
    /// a newer verdict kind.
    pub kind: String,
    /// Journaled: the wake it queued. Claimed: the claimed item's reason.
    pub wake_reason: Option<String>,
    /// Refused: "invalid_argument", "aborted", "failed_precondition".
    pub refusal: Option<String>,
    /// Items settled without a turn by this event.
    pub settled_without_turn: u64,
    /// Held sends: rows after the cursor, shown, left out.
    pub new_messages: u64,
    pub shown: u64,
    pub omitted: u64,
    pub duplicate_message: bool,
    /// Journaled: the row's ordinal (0: not journaled).
    pub ordinal: u64,
    /// Claimed: the wake carries a mute suggestion (an attention note).
    pub note_shown: bool,
    /// A memory pass's finish: the outcome recorded ("completed", "quiet_skipped", "failed").
    pub memory_outcome: Option<String>,
    /// A memory pass's finish: seconds from its slot to its start (`None`: never started).
    pub memory_delay_seconds: Option<u64>,
    /// Journaled or a Linear receipt: why the wake it earned was not queued ("duplicate",
    /// "queue_full").
    pub not_queued: Option<String>,
    /// A finish that left a failure notice owed to the person who asked.
    pub failure_notice_owed: bool,
    /// A confirmed own post: the failure notices it settled.
    pub failure_notices_settled: u64,
}

impl RedactedOutcome {
    fn kind(kind: &str) -> Self {
        RedactedOutcome { kind: kind.to_owned(), ..RedactedOutcome::default() }
    }

    /// Reduces a verdict. Verdict kinds this function does not know yet are named after their
    /// variant, with no details.
    pub fn of(verdict: &Verdict) -> Self {
        match verdict {
            Verdict::Journaled(journal) => RedactedOutcome {
                wake_reason: journal.wake.map(|reason| reason.as_str().to_owned()),
                duplicate_message: journal.duplicate_message,
                ordinal: journal.ordinal,
                not_queued: journal.not_queued.map(|n| n.as_str().to_owned()),
                failure_notices_settled: journal.notices_settled.len() as u64,
                ..RedactedOutcome::kind(if journal.surface.is_some() { "journaled" } else { "not_journaled" })
            },
            Verdict::AgentRegistered => RedactedOutcome::kind("agent_registered"),
            Verdict::Send(SendVerdict::Allowed { .. }) => RedactedOutcome::kind("send_allowed"),
            Verdict::Send(SendVerdict::NotContacted(refused)) => RedactedOutcome {
                refusal: Some(refused.reason.as_str().to_owned()),
                ..RedactedOutcome::kind("send_not_contacted")
            },
            Verdict::Send(SendVerdict::Held(held)) => RedactedOutcome {
                new_messages: held.new_messages,
                shown: held.shown.len() as u64,
                omitted: held.omitted,
                ..RedactedOutcome::kind("send_held")
            },
            Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn }) => RedactedOutcome {
                settled_without_turn: settled_without_turn.len() as u64,
                ..RedactedOutcome::kind("claimed_nothing")
            },
            Verdict::Claim(ClaimVerdict::Claimed(claimed)) => RedactedOutcome {
                wake_reason: Some(claimed.item.reason.as_str().to_owned()),
                settled_without_turn: claimed.settled_without_turn.len() as u64,
                note_shown: claimed.item.note.is_some(),
                ..RedactedOutcome::kind("claimed")
            },
            Verdict::Started { coalesced, .. } => {
                RedactedOutcome { settled_without_turn: coalesced.len() as u64, ..RedactedOutcome::kind("started") }
            }
            Verdict::Finished { requeued: true, .. } => RedactedOutcome::kind("requeued"),
            Verdict::Finished { requeued: false, memory_outcome, notice_owed, .. } => RedactedOutcome {
                failure_notice_owed: *notice_owed,
                memory_outcome: memory_outcome.as_ref().map(|o| o.outcome.as_str().to_owned()),
                memory_delay_seconds: memory_outcome
                    .as_ref()
                    .and_then(|o| o.delay_ns)
                    .map(|ns| u64::try_from(ns.max(0) / 1_000_000_000).unwrap_or(0)),
                ..RedactedOutcome::kind("finished")
            },
            Verdict::MemoryPassQueued { .. } => RedactedOutcome::kind("memory_pass_queued"),
            Verdict::LinearSession(session) => RedactedOutcome {
                wake_reason: session.wake.map(|reason| reason.as_str().to_owned()),
                not_queued: session.not_queued.map(|n| n.as_str().to_owned()),
                ..RedactedOutcome::kind("linear_session")
            },
            Verdict::Refused(refusal) => RedactedOutcome {
                refusal: Some(refusal_name(refusal.kind).to_owned()),
                ..RedactedOutcome::kind("refused")
            },
            #[allow(unreachable_patterns)] // Verdict kinds added after this file was written.
            other => RedactedOutcome::kind(&variant_name(other)),
        }
    }
}

pub fn refusal_name(kind: RefusalKind) -> &'static str {
    match kind {
        RefusalKind::InvalidArgument => "invalid_argument",
        RefusalKind::Aborted => "aborted",
        RefusalKind::FailedPrecondition => "failed_precondition",
    }
}

/// The snake-case name of a verdict's variant, from its debug text (only the leading identifier
/// is kept, so no field value can leak).
fn variant_name(verdict: &Verdict) -> String {
    let debug = format!("{verdict:?}");
    let mut name = String::new();
    for c in debug.chars().take_while(char::is_ascii_alphanumeric) {
        if c.is_ascii_uppercase() && !name.is_empty() {
            name.push('_');
        }
        name.push(c.to_ascii_lowercase());
    }
    name
}

/// Width of an analytics time bucket (UTC).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TimeBucket {
    Minute,
    Hour,
    Day,
}

impl TimeBucket {
    pub fn width_ns(self) -> i64 {
        const MINUTE_NS: i64 = 60 * 1_000_000_000;
        match self {
            TimeBucket::Minute => MINUTE_NS,
            TimeBucket::Hour => 60 * MINUTE_NS,
            TimeBucket::Day => 24 * 60 * MINUTE_NS,
        }
    }

    /// The start of the bucket holding `log_time_ns`.
    pub fn start_ns(self, log_time_ns: i64) -> i64 {
        log_time_ns.div_euclid(self.width_ns()) * self.width_ns()
    }
}

/// Events and bytes of one event type.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypeCounts {
    pub events: u64,
    pub event_bytes: u64,
    pub content_bytes: u64,
}

/// The fields [`Figures::observe`] reads, by event type and path: a finish's reported outcome,
/// a confirmed send's Slack target. The counted view ([`Redactor::redact_counted`]) carries
/// exactly these (from [`figure_fields`]); the figures read no other field (checked in debug
/// builds), so both views give the same figures.
pub const FIGURE_FIELDS: &[(&str, &str)] = &[
    ("wake_finish", "outcome"),
    ("send_confirmed", "target.slack.channel_id"),
    ("send_confirmed", "target.slack.thread_ts"),
];

/// The [`FIGURE_FIELDS`] of `envelope` that are set, as the full view names and orders them
/// (a set field of proto3: an enum not zero, a string not empty).
pub fn figure_fields(envelope: &crate::proto::Envelope) -> Vec<RedactedField> {
    use crate::proto::{envelope::Payload, reply_target::Target, WakeOutcome};
    let field = |path: &str, value: RedactedValue| RedactedField { path: path.to_owned(), value };
    match &envelope.payload {
        Some(Payload::WakeFinish(finish)) if finish.outcome != 0 => {
            let name = match WakeOutcome::try_from(finish.outcome) {
                Ok(outcome) => outcome.as_str_name().to_owned(),
                Err(_) => finish.outcome.to_string(),
            };
            vec![field("outcome", RedactedValue::Enum(name))]
        }
        Some(Payload::SendConfirmed(confirmed)) => {
            let Some(Target::Slack(slack)) = confirmed.target.as_ref().and_then(|t| t.target.as_ref()) else {
                return Vec::new();
            };
            [("target.slack.channel_id", &slack.channel_id), ("target.slack.thread_ts", &slack.thread_ts)]
                .into_iter()
                .filter(|(_, id)| !id.is_empty())
                .map(|(path, id)| field(path, RedactedValue::Id(id.clone())))
                .collect()
        }
        _ => Vec::new(),
    }
}

/// The derived figures of a set of redacted events with outcomes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Figures {
    pub events: u64,
    pub event_bytes: u64,
    pub sends_allowed: u64,
    pub sends_held: u64,
    /// Wakes queued, by reason.
    pub wakes_by_reason: BTreeMap<String, u64>,
    pub settled_without_turn: u64,
    pub claims: u64,
    /// Claimed wakes that carried a mute suggestion (the renderer may still drop it for budget).
    pub notes_shown: u64,
    pub starts: u64,
    /// Accepted finishes by the outcome the runtime reported; restart drains as "requeued".
    pub finishes_by_outcome: BTreeMap<String, u64>,
    pub refusals_by_kind: BTreeMap<String, u64>,
    /// Confirmed posts in DMs: in a thread, and on the main timeline.
    pub dm_replies_threaded: u64,
    pub dm_replies_top_level: u64,
    pub memory_passes_queued: u64,
    /// Wakes an observation earned that met a full queue (the agent was not woken for them).
    pub wakes_not_queued_queue_full: u64,
    /// Recorded memory-pass outcomes by name.
    pub memory_outcomes: BTreeMap<String, u64>,
    pub memory_delay_seconds_sum: u64,
    pub memory_delay_count: u64,
    /// Failure notices owed (a wake a person asked for was given up), and settled by a post.
    pub failure_notices_owed: u64,
    pub failure_notices_settled: u64,
    /// Sends refused before the hold by the do-not-contact check.
    pub sends_not_contacted: u64,
}

impl Figures {
    /// Held sends over all decided sends; 0 when there were none.
    pub fn send_hold_rate(&self) -> f64 {
        let decided = self.sends_allowed + self.sends_held;
        if decided == 0 {
            0.0
        } else {
            self.sends_held as f64 / decided as f64
        }
    }

    pub fn observe(&mut self, event: &RedactedEvent) {
        self.events += 1;
        self.event_bytes += event.event_bytes;
        let outcome = event.outcome.as_ref();
        let kind = outcome.map_or("", |o| o.kind.as_str());
        match kind {
            "send_allowed" => self.sends_allowed += 1,
            "send_held" => self.sends_held += 1,
            "send_not_contacted" => self.sends_not_contacted += 1,
            "claimed" => {
                self.claims += 1;
                self.notes_shown += u64::from(outcome.is_some_and(|o| o.note_shown));
            }
            "started" => self.starts += 1,
            "memory_pass_queued" => self.memory_passes_queued += 1,
            "requeued" => *self.finishes_by_outcome.entry("requeued".to_owned()).or_default() += 1,
            "finished" => {
                let reported = match figure_field(event, "outcome") {
                    Some(RedactedValue::Enum(name)) => name.trim_start_matches("WAKE_OUTCOME_").to_ascii_lowercase(),
                    _ => "unspecified".to_owned(),
                };
                *self.finishes_by_outcome.entry(reported).or_default() += 1;
                if let Some(memory) = outcome.and_then(|o| o.memory_outcome.clone()) {
                    *self.memory_outcomes.entry(memory).or_default() += 1;
                }
                if let Some(delay) = outcome.and_then(|o| o.memory_delay_seconds) {
                    self.memory_delay_seconds_sum += delay;
                    self.memory_delay_count += 1;
                }
            }
            "refused" => {
                let refusal = outcome.and_then(|o| o.refusal.clone()).unwrap_or_default();
                *self.refusals_by_kind.entry(refusal).or_default() += 1;
            }
            _ => {}
        }
        if let Some(reason) = outcome.and_then(|o| if kind == "journaled" { o.wake_reason.clone() } else { None }) {
            *self.wakes_by_reason.entry(reason).or_default() += 1;
        }
        self.settled_without_turn += outcome.map_or(0, |o| o.settled_without_turn);
        self.wakes_not_queued_queue_full +=
            u64::from(outcome.is_some_and(|o| o.not_queued.as_deref() == Some(NotQueued::QueueFull.as_str())));
        self.failure_notices_owed += u64::from(outcome.is_some_and(|o| o.failure_notice_owed));
        self.failure_notices_settled += outcome.map_or(0, |o| o.failure_notices_settled);
        let confirmed_post = event.event_type == "send_confirmed" && (outcome.is_none() || kind == "journaled");
        let id = |path| match figure_field(event, path) {
            Some(RedactedValue::Id(id)) => Some(id.as_str()),
            _ => None,
        };
        if confirmed_post && id("target.slack.channel_id").is_some_and(|c| c.starts_with('D')) {
            if id("target.slack.thread_ts").is_some_and(|t| !t.trim().is_empty()) {
                self.dm_replies_threaded += 1;
            } else {
                self.dm_replies_top_level += 1;
            }
        }
    }
}

/// A field the figures read; only [`FIGURE_FIELDS`] may be (the counted view carries no other).
fn figure_field<'a>(event: &'a RedactedEvent, path: &str) -> Option<&'a RedactedValue> {
    debug_assert!(
        FIGURE_FIELDS.contains(&(event.event_type.as_str(), path)),
        "the figures read {path} of {}, which is not in FIGURE_FIELDS",
        event.event_type
    );
    event.field(path)
}

/// Counts of one time bucket.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BucketCounts {
    pub types: BTreeMap<String, TypeCounts>,
    pub figures: Figures,
}

/// Counts and byte sums by event type and time bucket, and the derived figures, of the events
/// observed (in log order).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AnalyticsCounts {
    pub bucket: TimeBucket,
    /// By bucket start (unix ns).
    pub buckets: BTreeMap<i64, BucketCounts>,
    pub buckets_truncated: bool,
    pub total: Figures,
    pub first_seq: Option<u64>,
    pub last_seq: Option<u64>,
}

impl AnalyticsCounts {
    pub fn new(bucket: TimeBucket) -> Self {
        AnalyticsCounts {
            bucket,
            buckets: BTreeMap::new(),
            buckets_truncated: false,
            total: Figures::default(),
            first_seq: None,
            last_seq: None,
        }
    }

    pub fn observe(&mut self, event: &RedactedEvent) {
        self.first_seq.get_or_insert(event.seq);
        self.last_seq = Some(event.seq);
        self.total.observe(event);
        let start = self.bucket.start_ns(event.log_time_ns);
        if !self.buckets.contains_key(&start) && self.buckets.len() >= ANALYTICS_BUCKETS_MAX {
            self.buckets_truncated = true;
            return;
        }
        let bucket = self.buckets.entry(start).or_default();
        let types = bucket.types.entry(event.event_type.clone()).or_default();
        types.events += 1;
        types.event_bytes += event.event_bytes;
        types.content_bytes += event.content_bytes;
        bucket.figures.observe(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_floor_to_their_width() {
        assert_eq!(TimeBucket::Minute.start_ns(61_500_000_000), 60_000_000_000);
        assert_eq!(TimeBucket::Hour.start_ns(3_599_000_000_000), 0);
        assert_eq!(TimeBucket::Day.start_ns(-1), -86_400_000_000_000);
    }

    #[test]
    fn variant_names_keep_only_the_identifier() {
        assert_eq!(variant_name(&Verdict::AgentRegistered), "agent_registered");
        let finished = Verdict::Finished {
            item_id: "secret text".into(),
            requeued: false,
            notice_owed: false,
            memory_outcome: None,
        };
        assert_eq!(variant_name(&finished), "finished");
    }
}
