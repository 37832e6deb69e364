//! The API fuzzed: seeded, generated requests for every RPC of every service the server has, sent
//! with an admin token (so every request gets past auth to validation) to a whole server running
//! in this process on its own embedded log. Each answer must be one a client can act on:
//!
//! * it comes within [`CALL_TIME_MAX`] (a live stream may idle; its headers may not);
//! * its code is never one that says "the server is broken" or "you may not" ([`never_answered`]):
//!   no `INTERNAL`, no `UNKNOWN`, no `UNIMPLEMENTED`, and no auth refusal for the admin;
//! * a refusal about the request (INVALID_ARGUMENT, OUT_OF_RANGE, RESOURCE_EXHAUSTED, NOT_FOUND,
//!   ALREADY_EXISTS) starts with the fields it is about ([`names_a_field`]), each a path of proto
//!   field names that exists in the request's message, then `": "` and the reason. ABORTED and
//!   FAILED_PRECONDITION are about the state the request met (a claim lost, nothing running) and
//!   need not name one;
//! * its message is at most [`STATUS_MESSAGE_BYTES_MAX`] bytes, holds no raw control character,
//!   and never repeats more than [`ECHO_BYTES_MAX`] bytes of a long value the request sent
//!   ([`NAMED_WHOLE_BYTES_MAX`]).
//!
//! Health and reflection are tonic's own services: their answers are held to the code rule only
//! (tonic-reflection quotes the symbol asked for in full; the run counts how often that exceeds
//! the bound). Errors carried inside a stream's items (`AppendStream`'s `ErrorDetail`,
//! reflection's `ErrorResponse`) are answers too. After the run every API RPC has been both
//! accepted and refused at least once (else the generator lost its way), no thread of the server
//! panicked, health says SERVING for every service, a plain valid request still works, and the
//! server shuts down cleanly.
//!
//! Requests are built from the descriptors the server serves: each field gets a valid-looking
//! value (registered agents, real surfaces, Slack ts, UUIDv7 request ids, the item and plan a
//! claim returned, 32-byte digests) or, for the fields a case mutates, a hostile one (empty,
//! 1 MB, just over a bound, control characters, NUL, invalid UTF-8, wildcards, extreme numbers,
//! unknown enum values, wrong-length bytes, far too many list entries), and some bodies are
//! corrupted on the wire. Values the server hands back (item ids, plans, receipts, activity ids,
//! sequences) feed later requests, so accepted paths run as well as refused ones.
//!
//! `ANIMA_FUZZ_SEED=S` picks the seed (default [`SEED_DEFAULT`]) and `ANIMA_FUZZ_CASES=N` the
//! cases per RPC (default [`CASES_PER_RPC_DEFAULT`]); `ANIMA_FUZZ_VERBOSE=1` prints every answer.
//! A failure prints the seed, the case and the request. The requests are a function of the seed
//! and of what the server answered, and the server stamps events with the wall clock, so a rerun
//! of a seed replays the same requests unless an answer depended on timing. The table [`RPCS`] must name every served RPC, so an RPC added to the API fails
//! [`the_table_covers_every_served_rpc`] until it has a row here.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anima_engine::validate::ECHO_BYTES_MAX;
use anima_gateway::api;
use prost::bytes::{Buf, BufMut, Bytes};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor, ReflectMessage, Value};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::fixture::{admin, Fixture, ADMIN_TOKEN};

const SEED_DEFAULT: u64 = 1;
/// Cases per RPC in the default run: about a thousand calls in all, well within a minute.
const CASES_PER_RPC_DEFAULT: u64 = 32;
/// Longest wait for a call's answer (a unary answer, or a stream's headers and each item until
/// [`STREAM_IDLE`]). A command waits at most the verdict wait (10 s) for the fold; twice that is
/// a hang.
const CALL_TIME_MAX: Duration = Duration::from_secs(20);
/// A live stream (`Watch`, `Tap`, health `Watch`) that sends nothing for this long is dropped:
/// waiting for the next event is what it is for, not a hang.
const STREAM_IDLE: Duration = Duration::from_millis(250);
/// Items read from a streaming answer before it is dropped.
const STREAM_ITEMS_MAX: usize = 16;
/// The server clips every message to 2,048 bytes and marks the cut with `…`.
const STATUS_MESSAGE_BYTES_MAX: usize = anima_gateway::services::STATUS_MESSAGE_BYTES_MAX + "…".len();
/// A hostile value far over every bound.
const HUGE_BYTES: usize = 1_000_000;
/// Rounds (one case of every RPC each) of valid-looking requests only, at the start.
const WARM_UP_ROUNDS: u64 = 4;
/// Requests of a client stream, at most.
const STREAM_REQUESTS_MAX: u64 = 4;
/// Failures printed in full; the rest are counted.
const FAILURES_SHOWN_MAX: usize = 40;
/// A log time the valid-looking timestamps are near (2026-01-01T00:00:00Z).
const BASE_MS: i64 = 1_767_225_600_000;
/// Stands for invalid UTF-8 in a generated string: U+10FFFD (private use, never generated
/// otherwise) encodes as these four bytes, which the encoded body then gets instead.
const INVALID_UTF8_MARK: char = '\u{10FFFD}';
const INVALID_UTF8_MARK_BYTES: [u8; 4] = [0xF4, 0x8F, 0xBF, 0xBD];
const INVALID_UTF8_BYTES: [u8; 4] = [0xFF, 0xC0, 0x80, 0xFE];

// ---------------------------------------------------------------------------------------------
// The RPCs.

/// How an RPC is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Unary,
    /// One request, a stream of answers (read until it ends, idles or [`STREAM_ITEMS_MAX`]).
    ServerStream,
    /// A stream of requests and a stream of answers.
    Bidi,
}

/// Whose refusals the field rule covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Owner {
    /// This server's API: every refusal about the request names its field.
    Api,
    /// Health and reflection, served by tonic's crates: checked for their codes only.
    Library,
}

struct Rpc {
    path: &'static str,
    shape: Shape,
    owner: Owner,
}

const fn rpc(path: &'static str, shape: Shape, owner: Owner) -> Rpc {
    Rpc { path, shape, owner }
}

/// Every served RPC. A new one needs a row (and, when its fields are new, valid-looking values in
/// [`Generator::valid`], or its requests are only refused and the run says so).
const RPCS: [Rpc; 25] = [
    rpc("/anima.v1.Ingest/Append", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Ingest/AppendStream", Shape::Bidi, Owner::Api),
    rpc("/anima.v1.Wakes/Watch", Shape::ServerStream, Owner::Api),
    rpc("/anima.v1.Wakes/Claim", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Wakes/Start", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Wakes/Finish", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Wakes/Heartbeat", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Sends/Send", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Sends/Confirm", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Sends/Respond", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Sends/ConfirmResponse", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Subscriptions/Mute", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Subscriptions/Unmute", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Subscriptions/List", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Memory/Plan", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Memory/Status", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Replay/Read", Shape::ServerStream, Owner::Api),
    rpc("/anima.v1.Replay/StateAt", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Replay/Explain", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Analytics/Counts", Shape::Unary, Owner::Api),
    rpc("/anima.v1.Analytics/Tap", Shape::ServerStream, Owner::Api),
    rpc("/grpc.health.v1.Health/Check", Shape::Unary, Owner::Library),
    rpc("/grpc.health.v1.Health/Watch", Shape::ServerStream, Owner::Library),
    rpc("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", Shape::Bidi, Owner::Library),
    rpc("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", Shape::Bidi, Owner::Library),
];

/// The descriptors of everything the server serves: the API (what it registers for reflection),
/// health and both reflection versions.
fn served_pool() -> DescriptorPool {
    let mut pool = DescriptorPool::decode(api::DESCRIPTOR_SET).expect("the API's descriptors");
    for set in [
        tonic_health::pb::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
    ] {
        pool.decode_file_descriptor_set(set).expect("a library's descriptors");
    }
    pool
}

/// Every served `/package.Service/Method`, with the shape its descriptor gives it.
fn served_rpcs(pool: &DescriptorPool) -> BTreeMap<String, Shape> {
    pool.services()
        .flat_map(|service| {
            let name = service.full_name().to_owned();
            service
                .methods()
                .map(move |method| {
                    let shape = match (method.is_client_streaming(), method.is_server_streaming()) {
                        (false, false) => Shape::Unary,
                        (false, true) => Shape::ServerStream,
                        (true, _) => Shape::Bidi,
                    };
                    (format!("/{name}/{}", method.name()), shape)
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn the_table_covers_every_served_rpc() {
    let table: BTreeMap<String, Shape> = RPCS.iter().map(|rpc| (rpc.path.to_owned(), rpc.shape)).collect();
    assert_eq!(table, served_rpcs(&served_pool()), "give every served RPC a row in `RPCS`, with its shape");
}

// ---------------------------------------------------------------------------------------------
// Generating requests.

// Every case is a function of the seed.
use anima_engine::testing::SeededRng as Rng;

/// A wake the server handed out, to start, heartbeat and finish.
#[derive(Clone, Debug)]
struct Claimed {
    agent: String,
    worker: String,
    item: String,
    plan: Vec<api::PlanSurface>,
}

/// What the server told us so far: the material of valid-looking values.
#[derive(Default)]
struct Known {
    agents: Vec<String>,
    claims: Vec<Claimed>,
    /// (agent, session id, receipt ids of its wakes).
    sessions: Vec<(String, String, Vec<String>)>,
    /// (agent, activity id) of Linear responses.
    activities: Vec<(String, String)>,
    seqs: Vec<u64>,
    surfaces: Vec<String>,
    slack_ts: Vec<String>,
    chat_message_ids: Vec<String>,
    request_ids: Vec<String>,
    /// (agent, `target` or `chat_target`, the target) of accepted mutes, to unmute.
    muted: Vec<(String, String, DynamicMessage)>,
}

/// Who a case acts for, chosen first so that its fields agree with each other (the worker that
/// claimed the item, the plan the claim gave, the agent's own session).
struct Persona {
    agent: String,
    claim: Option<Claimed>,
    session: Option<(String, Vec<String>)>,
    activity: Option<String>,
}

struct Generator {
    rng: Rng,
    known: Known,
    /// Makes every fresh id and timestamp distinct.
    counter: u64,
}

/// Hostile strings that are not about size.
const HOSTILE_STRINGS: [&str; 22] = [
    "",
    " ",
    "*",
    ">",
    ".",
    "a.b",
    "a.*.>",
    "ada ",
    " ada",
    "ADA",
    "ada\0",
    "\0",
    "\u{1}\u{7}\u{1b}[31m",
    "line\nbreak",
    "tab\there",
    "\u{202e}ada",
    "😀",
    "..",
    "../../etc/passwd",
    "slack:T1:C1",
    "%00%ff",
    "0",
];

impl Generator {
    fn fresh(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    fn fresh_ts(&mut self) -> String {
        let ts = format!("{}.{:06}", 1_700_000_000 + self.fresh(), self.rng.below(1_000_000));
        self.known.slack_ts.push(ts.clone());
        ts
    }

    fn uuid_v7(&mut self) -> String {
        let mut random = [0u8; 10];
        random.iter_mut().for_each(|b| *b = self.rng.next_u64() as u8);
        let ms = (BASE_MS as u64) + self.fresh();
        uuid::Builder::from_unix_timestamp_millis(ms, &random).into_uuid().hyphenated().to_string()
    }

    /// Who a case of `rpc` acts for: for most cases of the RPCs that go on from something
    /// earlier (a claim, a Linear session, a response), an agent that has it, so that their
    /// accepted paths run too.
    fn persona(&mut self, rpc: &Rpc) -> Persona {
        let goes_on_from_a_claim =
            matches!(rpc.path, "/anima.v1.Wakes/Start" | "/anima.v1.Wakes/Finish" | "/anima.v1.Wakes/Heartbeat");
        let agent = if goes_on_from_a_claim && !self.known.claims.is_empty() && self.rng.percent(80) {
            self.rng.pick(&self.known.claims).agent.clone()
        } else if rpc.path == "/anima.v1.Sends/Respond" && !self.known.sessions.is_empty() && self.rng.percent(80) {
            self.rng.pick(&self.known.sessions).0.clone()
        } else if rpc.path == "/anima.v1.Sends/ConfirmResponse"
            && !self.known.activities.is_empty()
            && self.rng.percent(80)
        {
            self.rng.pick(&self.known.activities).0.clone()
        } else if self.rng.percent(90) {
            self.rng.pick(&["ada", "bob"]).to_string()
        } else if self.rng.percent(50) && !self.known.agents.is_empty() {
            self.rng.pick(&self.known.agents).clone()
        } else {
            "carol".to_owned()
        };
        let claim = self.known.claims.iter().rev().find(|c| c.agent == agent).cloned();
        let session = self
            .known
            .sessions
            .iter()
            .rev()
            .find(|(a, _, _)| *a == agent)
            .map(|(_, session, receipts)| (session.clone(), receipts.clone()));
        let activity = self.known.activities.iter().rev().find(|(a, _)| *a == agent).map(|(_, id)| id.clone());
        Persona { agent, claim, session, activity }
    }

    /// A valid-looking request of type `desc`.
    fn request(&mut self, desc: &MessageDescriptor, persona: &Persona) -> DynamicMessage {
        let mut request = self.message(desc, persona, 0);
        self.agree(&mut request, persona);
        request
    }

    /// Makes the fields of a valid-looking request agree where a request's fields depend on each
    /// other.
    fn agree(&mut self, request: &mut DynamicMessage, persona: &Persona) {
        let set = |request: &DynamicMessage, name: &str| request.has_field_by_name(name);
        match request.descriptor().name() {
            // A confirmation of a chat post carries its message id, of a Slack post its ts.
            "SendsConfirmRequest" => {
                let chat = matches!(
                    request.get_field_by_name("target").as_deref(),
                    Some(Value::Message(target)) if target.has_field_by_name("chat")
                );
                request.clear_field_by_name(if chat { "ts" } else { "message_id" });
            }
            // Unmute what was muted, mostly.
            "UnmuteRequest" if self.rng.percent(70) => {
                let muted = self.known.muted.iter().rev().find(|(agent, _, _)| *agent == persona.agent).cloned();
                if let Some((_, field, target)) = muted {
                    request.clear_field_by_name("target");
                    request.clear_field_by_name("chat_target");
                    request.set_field_by_name(&field, Value::Message(target));
                }
            }
            _ => {}
        }
        match request.descriptor().name() {
            // A Slack target or a chat target, not both.
            "MuteRequest" | "UnmuteRequest" if set(request, "target") && set(request, "chat_target") => {
                request.clear_field_by_name(if self.rng.percent(50) { "target" } else { "chat_target" });
            }
            _ => {}
        }
    }

    fn message(&mut self, desc: &MessageDescriptor, persona: &Persona, depth: usize) -> DynamicMessage {
        let mut message = DynamicMessage::new(desc.clone());
        // One member of each oneof (now and then none).
        let mut chosen = BTreeSet::new();
        for oneof in desc.oneofs() {
            let members: Vec<FieldDescriptor> = oneof.fields().collect();
            if !members.is_empty() && self.rng.percent(95) {
                chosen.insert(members[self.rng.index(members.len())].number());
            }
        }
        for field in desc.fields() {
            if field.containing_oneof().is_some() && !chosen.contains(&field.number()) {
                continue;
            }
            if let Some(value) = self.valid(desc, &field, persona, depth) {
                message.set_field(&field, value);
            }
        }
        message
    }

    /// A valid-looking value for `field` of `parent`; `None` leaves it unset.
    fn valid(
        &mut self,
        parent: &MessageDescriptor,
        field: &FieldDescriptor,
        persona: &Persona,
        depth: usize,
    ) -> Option<Value> {
        let string = |s: &str| Some(Value::String(s.to_owned()));
        let parent_name = parent.name();
        let claim = persona.claim.as_ref();
        match field.name() {
            "agent_id" if parent_name == "AgentRegistered" => {
                if self.rng.percent(70) {
                    string(&persona.agent)
                } else {
                    string(&format!("agent-{}", self.fresh()))
                }
            }
            "agent_id" | "receiving_agent_id" => string(&persona.agent),
            "receiving_agent_ids" => Some(Value::List(if self.rng.percent(80) {
                vec![Value::String(persona.agent.clone())]
            } else {
                vec![Value::String("ada".into()), Value::String("bob".into())]
            })),
            "worker_id" => string(&claim.map_or_else(|| format!("w{}", self.rng.below(3)), |c| c.worker.clone())),
            "item_id" if parent_name == "ClaimRequest" => string(&if self.rng.percent(85) {
                String::new()
            } else {
                claim.map(|c| c.item.clone()).unwrap_or_default()
            }),
            "item_id" => string(&claim.map(|c| c.item.clone()).unwrap_or_else(|| "item-1".into())),
            "plan" => Some(Value::List(
                claim.map(|c| c.plan.iter().map(|p| Value::Message(dynamic(field, p))).collect()).unwrap_or_default(),
            )),
            "request_id" => {
                let id = match self.rng.below(10) {
                    0..=5 => self.uuid_v7(),
                    6..=8 => String::new(),
                    _ if !self.known.request_ids.is_empty() => self.rng.pick(&self.known.request_ids).clone(),
                    _ => self.uuid_v7(),
                };
                if !id.is_empty() {
                    self.known.request_ids.push(id.clone());
                }
                string(&id)
            }
            // The send a confirmation answers: none, or one of the request ids sent so far.
            "send_request_id" => string(&if self.rng.percent(60) || self.known.request_ids.is_empty() {
                String::new()
            } else {
                self.rng.pick(&self.known.request_ids).clone()
            }),
            "correlation_id" => string(&format!("c-{}", self.fresh())),
            "team_id" => string("T1"),
            "channel_id" => string(self.rng.pick::<&str>(&["C1", "C2", "D1"])),
            "ts" => {
                let ts = if self.rng.percent(80) || self.known.slack_ts.is_empty() {
                    self.fresh_ts()
                } else {
                    self.rng.pick(&self.known.slack_ts).clone()
                };
                string(&ts)
            }
            "thread_ts" => string(&if self.rng.percent(60) || self.known.slack_ts.is_empty() {
                String::new()
            } else {
                self.rng.pick(&self.known.slack_ts).clone()
            }),
            "subtype" => string(""),
            "user_id" => string(self.rng.pick::<&str>(&["U1", "U2", "U0ADA", "U0BOB"])),
            "bot_id" => string(if self.rng.percent(80) { "" } else { "B0ADA" }),
            "text" | "body" | "prompt_text" => {
                string(self.rng.pick::<&str>(&["hello", "hello <@U0ADA>", "hi <@U0BOB> and <@U0ADA>", "ok"]))
            }
            "user_name" | "sender_name" | "display_name" => string("Person One"),
            "slack_bot_user_id" => string(&format!("U0N{}", self.fresh())),
            "slack_bot_id" => string(&format!("B0N{}", self.fresh())),
            "chat_user_id" => string(&format!("ou_n{}", self.fresh())),
            "tenant_id" => string("tn1"),
            "chat_id" => string(self.rng.pick::<&str>(&["oc_1", "oc_2"])),
            "message_id" => {
                let id = format!("om_{}", self.fresh());
                self.known.chat_message_ids.push(id.clone());
                string(&id)
            }
            "thread_id" => string(&if self.rng.percent(60) || self.known.chat_message_ids.is_empty() {
                String::new()
            } else {
                self.rng.pick(&self.known.chat_message_ids).clone()
            }),
            "sender_id" => string(self.rng.pick::<&str>(&["ou_1", "ou_2", "ou_ada"])),
            "mentioned_user_ids" => {
                Some(Value::List(if self.rng.percent(50) { vec![Value::String("ou_ada".into())] } else { Vec::new() }))
            }
            "sender_is_bot" | "restart_drain" => Some(Value::Bool(self.rng.percent(10))),
            "session_id" => string(&match &persona.session {
                Some((session, _)) if self.rng.percent(70) => session.clone(),
                _ => self.uuid_v7(),
            }),
            "installation_id" => string("inst1"),
            "agent_activity_id" => string(&format!("act-{}", self.fresh())),
            "issue_identifier" => string("ENG-7"),
            "issue_url" => string("https://linear.app/acme/issue/ENG-7/a-title"),
            "issue_title" => string("A title"),
            "input_ids" => Some(Value::List(
                persona
                    .session
                    .as_ref()
                    .map(|(_, r)| r.iter().cloned().map(Value::String).collect())
                    .unwrap_or_default(),
            )),
            "activity_id" => {
                let activity = match persona.activity.clone() {
                    Some(activity) => activity,
                    None => self.uuid_v7(),
                };
                string(&activity)
            }
            "memory_digest_before" | "memory_digest_after" => {
                Some(Value::Bytes((0..32).map(|_| self.rng.next_u64() as u8).collect()))
            }
            "reason" => string("done"),
            "memory_md_bytes" => Some(Value::U64(self.rng.below(20_000))),
            "draft_bytes" => Some(Value::U64(self.rng.below(2_000))),
            "size_bytes" => Some(Value::U64(self.rng.below(100_000))),
            "name" => string("notes.txt"),
            "url" => string("https://example.com/page"),
            "title" => string("A page"),
            "seq" => Some(Value::U64(if self.known.seqs.is_empty() || self.rng.percent(10) {
                1
            } else {
                *self.rng.pick(&self.known.seqs)
            })),
            "log_time_ns" => {
                Some(Value::I64((BASE_MS - 86_400_000 + self.rng.below(400 * 86_400_000) as i64) * 1_000_000))
            }
            "limit" => Some(Value::U64(self.rng.below(20))),
            "with_outcomes" => Some(Value::Bool(self.rng.percent(30))),
            "event_types" => Some(Value::List(if self.rng.percent(50) {
                vec![Value::String(self.rng.pick(&["slack_message", "send", "wake_claim"]).to_string())]
            } else {
                Vec::new()
            })),
            "surface" => string(&if self.rng.percent(30) || self.known.surfaces.is_empty() {
                String::new()
            } else {
                self.rng.pick(&self.known.surfaces).clone()
            }),
            "as_of_ms" => Some(Value::I64(if self.rng.percent(50) { 0 } else { BASE_MS })),
            "occurred_at_ms" => Some(Value::I64(if self.rng.percent(30) { 0 } else { BASE_MS })),
            // Health.
            "service" => string(self.rng.pick::<&str>(&["", "anima.v1.Wakes", "anima.v1.Replay"])),
            // Reflection.
            "host" => string(""),
            "list_services" => string(""),
            "file_by_filename" => string("anima/v1/api.proto"),
            "file_containing_symbol" | "all_extension_numbers_of_type" | "containing_type" => {
                string("anima.v1.AppendRequest")
            }
            "extension_number" => Some(Value::I32(1)),
            _ => self.generic(field, persona, depth),
        }
    }

    /// A value for a field the names above do not know: by its type.
    fn generic(&mut self, field: &FieldDescriptor, persona: &Persona, depth: usize) -> Option<Value> {
        if field.is_list() {
            let n = if depth < 3 { self.rng.below(3) } else { 0 };
            let values = (0..n).filter_map(|_| self.generic_one(field, persona, depth)).collect();
            return Some(Value::List(values));
        }
        self.generic_one(field, persona, depth)
    }

    fn generic_one(&mut self, field: &FieldDescriptor, persona: &Persona, depth: usize) -> Option<Value> {
        Some(match field.kind() {
            Kind::Message(desc) => {
                if depth >= 4 || self.rng.percent(10) {
                    return None;
                }
                Value::Message(self.message(&desc, persona, depth + 1))
            }
            Kind::Enum(desc) => {
                let values: Vec<i32> = desc.values().map(|v| v.number()).filter(|n| *n != 0).collect();
                Value::EnumNumber(if values.is_empty() { 0 } else { *self.rng.pick(&values) })
            }
            Kind::String => Value::String(format!("x{}", self.fresh())),
            Kind::Bytes => Value::Bytes((0..32).map(|_| self.rng.next_u64() as u8).collect()),
            Kind::Bool => Value::Bool(self.rng.percent(50)),
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(self.rng.below(100) as i32),
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(self.rng.below(100) as i64),
            Kind::Uint32 | Kind::Fixed32 => Value::U32(self.rng.below(100) as u32),
            Kind::Uint64 | Kind::Fixed64 => Value::U64(self.rng.below(100)),
            Kind::Float => Value::F32(1.5),
            Kind::Double => Value::F64(1.5),
        })
    }

    /// Replaces one field somewhere in `message` with a hostile value (or a valid-looking value of
    /// another case, or nothing).
    fn mutate(&mut self, message: &mut DynamicMessage, persona: &Persona, depth: usize) {
        let fields: Vec<FieldDescriptor> = message.descriptor().fields().collect();
        if fields.is_empty() {
            return;
        }
        let field = fields[self.rng.index(fields.len())].clone();
        // Into a set nested message, now and then.
        let nested = !field.is_list() && matches!(field.kind(), Kind::Message(_)) && message.has_field(&field);
        if nested && depth < 4 && self.rng.percent(70) {
            if let Value::Message(inner) = message.get_field_mut(&field) {
                self.mutate(inner, persona, depth + 1);
                return;
            }
        }
        match self.rng.below(10) {
            0 => message.clear_field(&field),
            1 => {
                let parent = message.descriptor();
                if let Some(value) = self.valid(&parent, &field, persona, depth) {
                    message.set_field(&field, value);
                }
            }
            _ => {
                let value = self.hostile(&field, persona, depth);
                message.set_field(&field, value);
            }
        }
    }

    fn hostile(&mut self, field: &FieldDescriptor, persona: &Persona, depth: usize) -> Value {
        if field.is_list() {
            let one = |g: &mut Generator| g.hostile_one(field, persona, depth);
            return Value::List(match self.rng.below(5) {
                0 => Vec::new(),
                1 => vec![one(self)],
                // Far more entries than any bound (each small).
                2 => {
                    let n = *self.rng.pick(&[17, 65, 101, 1_000]);
                    (0..n).filter_map(|_| self.generic_one(field, persona, depth.max(3))).collect()
                }
                _ => {
                    let mut values: Vec<Value> =
                        (0..self.rng.below(3)).filter_map(|_| self.generic_one(field, persona, depth)).collect();
                    let at = self.rng.index(values.len() + 1);
                    values.insert(at, one(self));
                    values
                }
            });
        }
        self.hostile_one(field, persona, depth)
    }

    fn hostile_one(&mut self, field: &FieldDescriptor, persona: &Persona, depth: usize) -> Value {
        match field.kind() {
            Kind::String => Value::String(self.hostile_string()),
            Kind::Bytes => {
                let n = *self.rng.pick(&[0, 1, 31, 33, 64, 4_096, 900_000]);
                Value::Bytes((0..n).map(|_| self.rng.next_u64() as u8).collect())
            }
            Kind::Enum(_) => Value::EnumNumber(*self.rng.pick(&[-1, 4, 6, 99, i32::MAX, i32::MIN])),
            Kind::Bool => Value::Bool(self.rng.percent(50)),
            Kind::Int32 | Kind::Sint32 | Kind::Sfixed32 => Value::I32(*self.rng.pick(&[-1, i32::MIN, i32::MAX])),
            Kind::Int64 | Kind::Sint64 | Kind::Sfixed64 => Value::I64(*self.rng.pick(&[
                -1,
                i64::MIN,
                i64::MAX,
                i64::MAX / 1_000,
                BASE_MS * 1_000_000,
                253_402_300_800_000,
                -86_400_000,
            ])),
            Kind::Uint32 | Kind::Fixed32 => Value::U32(*self.rng.pick(&[u32::MAX, 1 << 31])),
            Kind::Uint64 | Kind::Fixed64 => Value::U64(*self.rng.pick(&[u64::MAX, 1 << 63, 1 << 53, u64::MAX - 1])),
            Kind::Float => Value::F32(*self.rng.pick(&[f32::NAN, f32::INFINITY, -0.0])),
            Kind::Double => Value::F64(*self.rng.pick(&[f64::NAN, f64::NEG_INFINITY, 1e308])),
            Kind::Message(desc) => {
                if self.rng.percent(50) {
                    Value::Message(DynamicMessage::new(desc))
                } else {
                    // A nested message with everything in it hostile.
                    let mut inner = self.message(&desc, persona, depth + 1);
                    for _ in 0..4 {
                        self.mutate(&mut inner, persona, depth + 1);
                    }
                    Value::Message(inner)
                }
            }
        }
    }

    fn hostile_string(&mut self) -> String {
        match self.rng.below(12) {
            0 => "x".repeat(HUGE_BYTES),
            // Just over the bounds the engine documents.
            1 => "x".repeat(*self.rng.pick(&[65, 97, 129, 257, 1_025, 2_049, 4_097, 160_001])),
            // Multi-byte characters, so that a clipped echo ends inside one.
            2 => "é".repeat(*self.rng.pick(&[40, 33, 600_000])),
            3 => format!("ada{INVALID_UTF8_MARK}"),
            4 => format!("{}\u{0}{}", "a".repeat(100), "b".repeat(100)),
            5 => "\u{7f}\u{9b}".repeat(50),
            _ => self.rng.pick(&HOSTILE_STRINGS).to_string(),
        }
    }
}

/// `value` as a dynamic message of the type of `field`.
fn dynamic(field: &FieldDescriptor, value: &impl prost::Message) -> DynamicMessage {
    let Kind::Message(desc) = field.kind() else { panic!("{} is not a message field", field.full_name()) };
    DynamicMessage::decode(desc, value.encode_to_vec().as_slice()).expect("a message of its own type")
}

/// The encoded body of `message`, with every invalid-UTF-8 mark replaced by bytes that are not
/// UTF-8 (same length, so every length prefix stays right).
fn encode(message: &DynamicMessage) -> Vec<u8> {
    let mut bytes = message.encode_to_vec();
    let mut at = 0;
    while let Some(found) = bytes[at..].windows(4).position(|w| w == INVALID_UTF8_MARK_BYTES) {
        let start = at + found;
        bytes[start..start + 4].copy_from_slice(&INVALID_UTF8_BYTES);
        at = start + 4;
    }
    bytes
}

/// A body broken on the wire: cut short, trailed by garbage, a byte flipped, a field of the wrong
/// wire type in front, random bytes, or (decodable) an unknown field.
fn corrupt(rng: &mut Rng, mut bytes: Vec<u8>) -> (Vec<u8>, &'static str) {
    match rng.below(6) {
        0 if !bytes.is_empty() => {
            bytes.truncate(rng.index(bytes.len()));
            (bytes, "truncated")
        }
        1 => {
            bytes.extend((0..1 + rng.below(8)).map(|_| rng.next_u64() as u8));
            (bytes, "garbage appended")
        }
        2 if !bytes.is_empty() => {
            let at = rng.index(bytes.len());
            bytes[at] ^= 1 << rng.below(8);
            (bytes, "a bit flipped")
        }
        3 => {
            // Field 1 as a fixed64 and as a group start: a wire type no request field has.
            let mut front = if rng.percent(50) { vec![0x09, 1, 2, 3, 4, 5, 6, 7, 8] } else { vec![0x0B] };
            front.extend(bytes);
            (front, "wrong wire type")
        }
        4 => ((0..rng.below(64)).map(|_| rng.next_u64() as u8).collect(), "random bytes"),
        _ => {
            // Field 999, varint: unknown, so skipped.
            bytes.extend([0xB8, 0x3E, 0x01]);
            (bytes, "unknown field")
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Calling.

/// Sends and receives bodies as they are, so a request can be anything on the wire.
#[derive(Clone, Copy, Default)]
struct RawCodec;

struct RawEncoder;

struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

/// A status an answer carried: the call's own, or one inside a streamed item.
#[derive(Debug)]
struct Answered {
    code: Code,
    message: String,
    place: &'static str,
}

struct Answer {
    statuses: Vec<Answered>,
    responses: Vec<Bytes>,
    elapsed: Duration,
    /// What did not come within [`CALL_TIME_MAX`].
    hung: Option<&'static str>,
}

impl Answer {
    fn ok(&self) -> bool {
        self.hung.is_none() && self.statuses.is_empty()
    }
}

/// Calls `rpc` with `bodies` as its request messages, as the admin, and reads the answer.
async fn call(channel: &Channel, rpc: &Rpc, bodies: Vec<Bytes>) -> Answer {
    let started = Instant::now();
    let mut grpc = tonic::client::Grpc::new(channel.clone()).max_decoding_message_size(64 * 1024 * 1024);
    let mut request = tonic::Request::new(futures::stream::iter(bodies));
    request.metadata_mut().insert("authorization", format!("Bearer {ADMIN_TOKEN}").parse().expect("ascii"));
    let path: http::uri::PathAndQuery = rpc.path.parse().expect("a gRPC path");
    let mut statuses = Vec::new();
    let mut responses = Vec::new();
    let hung = async {
        if let Err(e) = tokio::time::timeout(CALL_TIME_MAX, grpc.ready()).await.map_err(|_| "the channel")? {
            statuses.push(Answered { code: Code::Unavailable, message: e.to_string(), place: "channel" });
            return Ok(());
        }
        let response = tokio::time::timeout(CALL_TIME_MAX, grpc.streaming(request, path, RawCodec))
            .await
            .map_err(|_| "the response headers")?;
        let mut stream = match response {
            Ok(response) => response.into_inner(),
            Err(status) => {
                statuses.push(Answered { code: status.code(), message: status.message().to_owned(), place: "call" });
                return Ok(());
            }
        };
        while responses.len() < STREAM_ITEMS_MAX {
            let next = match rpc.shape {
                Shape::Unary | Shape::Bidi => {
                    tokio::time::timeout(CALL_TIME_MAX, stream.message()).await.map_err(|_| "the answer")?
                }
                // A live stream idling is not a hang: drop it.
                Shape::ServerStream => match tokio::time::timeout(STREAM_IDLE, stream.message()).await {
                    Ok(next) => next,
                    Err(_) => break,
                },
            };
            match next {
                Ok(Some(message)) => responses.push(message),
                Ok(None) => break,
                Err(status) => {
                    statuses.push(Answered {
                        code: status.code(),
                        message: status.message().to_owned(),
                        place: "stream",
                    });
                    break;
                }
            }
        }
        Ok(())
    }
    .await
    .err();
    Answer { statuses, responses, elapsed: started.elapsed(), hung }
}

/// Errors a streamed answer carries inside its items.
fn in_band_errors(rpc: &Rpc, pool: &DescriptorPool, response: &[u8]) -> Option<Answered> {
    if rpc.path == "/anima.v1.Ingest/AppendStream" {
        let response = api::AppendStreamResponse::decode(response).ok()?;
        return match response.result? {
            api::append_stream_response::Result::Error(e) => {
                Some(Answered { code: Code::from(e.code), message: e.message, place: "ErrorDetail" })
            }
            api::append_stream_response::Result::Appended(_) => None,
        };
    }
    if rpc.path.starts_with("/grpc.reflection.") {
        let output = method_of(pool, rpc.path).output();
        let response = DynamicMessage::decode(output, response).ok()?;
        if !response.has_field_by_name("error_response") {
            return None;
        }
        let Value::Message(error) = response.get_field_by_name("error_response")?.into_owned() else { return None };
        let code = error.get_field_by_name("error_code")?.as_i32()?;
        let message = error.get_field_by_name("error_message")?.as_str()?.to_owned();
        return Some(Answered { code: Code::from(code), message, place: "ErrorResponse" });
    }
    None
}

fn method_of(pool: &DescriptorPool, path: &str) -> prost_reflect::MethodDescriptor {
    let (service, method) = path.trim_start_matches('/').split_once('/').expect("a gRPC path");
    let service = pool.get_service_by_name(service).expect("a served service");
    let method = service.methods().find(|m| m.name() == method).expect("a served method");
    method
}

// ---------------------------------------------------------------------------------------------
// Judging answers.

/// Codes that are never a right answer to the admin: the server is broken (INTERNAL, UNKNOWN,
/// DATA_LOSS), does not serve what it lists (UNIMPLEMENTED), or refuses the one token that may
/// do everything.
fn never_answered(code: Code) -> bool {
    matches!(
        code,
        Code::Internal
            | Code::Unknown
            | Code::DataLoss
            | Code::Unimplemented
            | Code::Unauthenticated
            | Code::PermissionDenied
    )
}

/// Codes that say "this request is wrong" or "what it names does not exist": the client must be
/// told which field.
fn is_about_the_request(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument | Code::OutOfRange | Code::ResourceExhausted | Code::NotFound | Code::AlreadyExists
    )
}

/// Whether a refusal names a field: it starts with `PATH[, PATH...]: REASON`, where each PATH is
/// `request` (the message as a whole: undecodable, over the transport limit) or a dotted path of
/// proto field names (`[i]` after a list field allowed; the last one may be a oneof) that
/// exists, starting at the request's message or at any message type inside it — so `ts` of the
/// Slack message inside an `AppendRequest`, `range.from.log_time_ns`, `target, chat_target`.
fn names_a_field(message: &str, request: &MessageDescriptor) -> bool {
    let Some((head, reason)) = message.split_once(": ") else { return false };
    if reason.trim().is_empty() || head.is_empty() {
        return false;
    }
    if head == "request" {
        return true;
    }
    let types = reachable_types(request);
    head.split(", ").all(|path| types.iter().any(|desc| path_resolves(desc, path)))
}

/// The request's message type and every message type its fields hold, transitively.
fn reachable_types(request: &MessageDescriptor) -> Vec<MessageDescriptor> {
    let mut seen = BTreeSet::new();
    let mut types = vec![request.clone()];
    let mut at = 0;
    seen.insert(request.full_name().to_owned());
    while at < types.len() {
        let desc = types[at].clone();
        for field in desc.fields() {
            if let Kind::Message(inner) = field.kind() {
                if seen.insert(inner.full_name().to_owned()) {
                    types.push(inner);
                }
            }
        }
        at += 1;
    }
    types
}

fn path_resolves(desc: &MessageDescriptor, path: &str) -> bool {
    let segments: Vec<&str> = path.split('.').collect();
    let mut current = desc.clone();
    for (i, segment) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        let name = match segment.split_once('[') {
            None => *segment,
            Some((name, index)) => {
                let Some(index) = index.strip_suffix(']') else { return false };
                if index.parse::<usize>().is_err() {
                    return false;
                }
                name
            }
        };
        // A oneof member that holds a message may be left out (`target.thread_ts` for
        // `target.slack.thread_ts`): only one member can be set, so the path stays unambiguous.
        let field = current.get_field_by_name(name).or_else(|| {
            current
                .oneofs()
                .flat_map(|oneof| oneof.fields().collect::<Vec<_>>())
                .filter_map(|member| match member.kind() {
                    Kind::Message(inner) => inner.get_field_by_name(name),
                    _ => None,
                })
                .next()
        });
        match field {
            Some(field) if last => return !segment.contains('[') || field.is_list(),
            Some(field) => match field.kind() {
                Kind::Message(inner) => current = inner,
                _ => return false,
            },
            None => return last && !segment.contains('[') && current.oneofs().any(|o| o.name() == name),
        }
    }
    false
}

/// Values a refusal may name whole: ids are at most 128 bytes (chat ids 96), and a message may
/// name an id, or a surface key made of ids, as it is. Anything longer (text, a value over its
/// bound) is quoted at most [`ECHO_BYTES_MAX`] bytes.
const NAMED_WHOLE_BYTES_MAX: usize = 256;

/// The first bytes (a little over [`ECHO_BYTES_MAX`]) of every string the request holds that is
/// longer than a refusal may name whole.
fn long_values(message: &DynamicMessage, out: &mut Vec<String>) {
    for (_, value) in message.fields() {
        let values: Vec<&Value> = match value {
            Value::List(values) => values.iter().collect(),
            value => vec![value],
        };
        for value in values {
            match value {
                Value::String(s) if s.len() > NAMED_WHOLE_BYTES_MAX => {
                    let mut end = ECHO_BYTES_MAX + 1;
                    while !s.is_char_boundary(end) {
                        end += 1;
                    }
                    out.push(s[..end].to_owned());
                }
                Value::Message(inner) => long_values(inner, out),
                _ => {}
            }
        }
    }
}

/// What is wrong with one status an answer carried, if anything.
fn judge(rpc: &Rpc, request: &MessageDescriptor, long: &[String], answered: &Answered) -> Option<String> {
    let Answered { code, message, place } = answered;
    let shown = anima_engine::validate::echo(message);
    if never_answered(*code) {
        return Some(format!("{place}: {code:?} {shown}"));
    }
    // tonic-reflection quotes the symbol or file asked for in full, control characters and all,
    // and its service cannot be wrapped: the library's wording, not this server's. Its codes are
    // checked here; the run counts its over-long messages (see `library_quotes`).
    if rpc.owner == Owner::Library {
        return None;
    }
    if message.len() > STATUS_MESSAGE_BYTES_MAX {
        return Some(format!("{place}: {code:?} with a {} byte message: {shown}", message.len()));
    }
    if message.chars().any(char::is_control) {
        return Some(format!("{place}: {code:?} with a raw control character: {shown}"));
    }
    if let Some(value) =
        long.iter().find(|v| message.contains(v.as_str()) || message.contains(format!("{v:?}").trim_matches('"')))
    {
        return Some(format!(
            "{place}: {code:?} repeats more than {ECHO_BYTES_MAX} bytes of {}",
            anima_engine::validate::echo(value)
        ));
    }
    if rpc.owner == Owner::Api && is_about_the_request(*code) && !names_a_field(message, request) {
        return Some(format!("{place}: {code:?} names no field of {}: {shown}", request.name()));
    }
    None
}

/// A request, short: strings echoed clipped, with their length when long.
fn describe(message: &DynamicMessage) -> String {
    let fields: Vec<String> =
        message.fields().map(|(field, value)| format!("{}: {}", field.name(), describe_value(value))).collect();
    format!("{} {{ {} }}", message.descriptor().name(), fields.join(", "))
}

fn describe_value(value: &Value) -> String {
    match value {
        Value::String(s) if s.len() > ECHO_BYTES_MAX => {
            format!("{} ({} bytes)", anima_engine::validate::echo(s), s.len())
        }
        Value::String(s) => format!("{s:?}"),
        Value::Bytes(b) => format!("<{} bytes>", b.len()),
        Value::Message(m) => describe(m),
        Value::List(values) if values.len() > 4 => {
            format!("[{} items, first {}]", values.len(), describe_value(&values[0]))
        }
        Value::List(values) => format!("[{}]", values.iter().map(describe_value).collect::<Vec<_>>().join(", ")),
        other => format!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Learning from answers.

impl Known {
    fn appended(&mut self, response: &api::AppendResponse) {
        for outcome in &response.outcomes {
            if !outcome.agent_id.is_empty() && !self.agents.contains(&outcome.agent_id) {
                self.agents.push(outcome.agent_id.clone());
            }
            self.seqs.push(outcome.seq);
            if !outcome.surface.is_empty() && !self.surfaces.contains(&outcome.surface) {
                self.surfaces.push(outcome.surface.clone());
            }
            if let Some(session) = outcome.surface.strip_prefix("linear:") {
                match self.sessions.iter_mut().find(|(a, s, _)| *a == outcome.agent_id && s == session) {
                    Some((_, _, receipts)) if !outcome.receipt_id.is_empty() => {
                        receipts.push(outcome.receipt_id.clone())
                    }
                    Some(_) => {}
                    None => self.sessions.push((
                        outcome.agent_id.clone(),
                        session.to_owned(),
                        [outcome.receipt_id.clone()].into_iter().filter(|r| !r.is_empty()).collect(),
                    )),
                }
            }
        }
    }

    /// Remembers what an accepted answer to `request` handed out.
    fn learn(&mut self, rpc: &Rpc, request: &DynamicMessage, responses: &[Bytes]) {
        let text = |name: &str| {
            request.get_field_by_name(name).and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
        };
        for response in responses {
            match rpc.path {
                "/anima.v1.Ingest/Append" => {
                    if let Ok(response) = api::AppendResponse::decode(response.as_ref()) {
                        self.appended(&response);
                    }
                }
                "/anima.v1.Ingest/AppendStream" => {
                    if let Ok(api::AppendStreamResponse {
                        result: Some(api::append_stream_response::Result::Appended(response)),
                        ..
                    }) = api::AppendStreamResponse::decode(response.as_ref())
                    {
                        self.appended(&response);
                    }
                }
                "/anima.v1.Wakes/Claim" => {
                    if let Some(wake) = api::ClaimResponse::decode(response.as_ref()).ok().and_then(|r| r.wake) {
                        self.claims.retain(|c| c.agent != wake.agent_id);
                        self.claims.push(Claimed {
                            agent: wake.agent_id,
                            worker: text("worker_id"),
                            item: wake.item_id,
                            plan: wake.plan,
                        });
                    }
                }
                "/anima.v1.Wakes/Finish" => {
                    let (agent, item) = (text("agent_id"), text("item_id"));
                    self.claims.retain(|c| c.agent != agent || c.item != item);
                }
                "/anima.v1.Subscriptions/Mute" => {
                    for field in ["target", "chat_target"] {
                        if let Some(Value::Message(target)) = request
                            .has_field_by_name(field)
                            .then(|| request.get_field_by_name(field))
                            .flatten()
                            .as_deref()
                        {
                            self.muted.push((text("agent_id"), field.to_owned(), target.clone()));
                        }
                    }
                }
                "/anima.v1.Sends/Respond" => {
                    if let Ok(response) = api::RespondResponse::decode(response.as_ref()) {
                        self.activities.push((text("agent_id"), response.activity_id));
                    }
                }
                _ => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Threads of the runtime the server runs on: a panic on one of them fails the run.
const SERVER_THREAD: &str = "anima-fuzz-server";

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

/// What the run saw of one RPC.
#[derive(Default)]
struct Seen {
    calls: u64,
    accepted: u64,
    refused: u64,
    codes: BTreeMap<String, u64>,
    slowest: Duration,
}

#[test]
fn generated_requests_for_every_rpc_get_answers_a_client_can_act_on() {
    let seed = env_u64("ANIMA_FUZZ_SEED").unwrap_or(SEED_DEFAULT);
    let cases = env_u64("ANIMA_FUZZ_CASES").unwrap_or(CASES_PER_RPC_DEFAULT);
    println!("API fuzz: seed {seed}, {cases} cases per RPC (ANIMA_FUZZ_SEED, ANIMA_FUZZ_CASES)");
    let panics: Arc<Mutex<Vec<String>>> = Arc::default();
    let previous = std::panic::take_hook();
    let recorded = panics.clone();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current().name().is_some_and(|name| name.starts_with(SERVER_THREAD)) {
            recorded.lock().unwrap().push(info.to_string());
        }
        previous(info);
    }));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name(SERVER_THREAD)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(run(seed, cases, panics));
}

async fn run(seed: u64, cases: u64, panics: Arc<Mutex<Vec<String>>>) {
    let started = Instant::now();
    let Fixture { server, channel, dir: _dir } = Fixture::start().await;

    let pool = served_pool();
    let served = served_rpcs(&pool);
    assert_eq!(
        RPCS.iter().map(|r| r.path.to_owned()).collect::<BTreeSet<_>>(),
        served.keys().cloned().collect(),
        "the table is every served RPC"
    );
    // The server's own list of services (reflection) holds nothing the table lacks.
    let listed = list_services(&channel).await;
    let tabled: BTreeSet<String> =
        RPCS.iter().map(|r| r.path.trim_start_matches('/').split_once('/').expect("a path").0.to_owned()).collect();
    assert!(listed.is_subset(&tabled), "the server lists services the table lacks: {:?}", listed.difference(&tabled));

    let verbose = std::env::var("ANIMA_FUZZ_VERBOSE").is_ok_and(|v| v == "1");
    let mut generator = Generator { rng: Rng(seed), known: Known::default(), counter: 0 };
    let mut seen: BTreeMap<&'static str, Seen> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut case = 0u64;
    // Messages of health and reflection over the bound this server keeps for its own.
    let mut library_quotes = 0;
    for round in 0..cases {
        // The first rounds only send valid-looking requests, in the table's order (ingest before
        // claims before starts, responses before their confirmations), so that the values later
        // requests build on exist; then anything goes, in any order.
        let warm_up = round < WARM_UP_ROUNDS;
        let mut order: Vec<&Rpc> = RPCS.iter().collect();
        for i in (1..order.len()).rev() {
            if !warm_up {
                order.swap(i, generator.rng.index(i + 1));
            }
        }
        for rpc in order {
            case += 1;
            let method = method_of(&pool, rpc.path);
            let input = method.input();
            let persona = generator.persona(rpc);
            let count = match rpc.shape {
                Shape::Bidi => 1 + generator.rng.below(STREAM_REQUESTS_MAX),
                _ => 1,
            };
            let mut requests = Vec::new();
            let mut bodies = Vec::new();
            let mut notes = Vec::new();
            let mut mutated = 0;
            for _ in 0..count {
                let mut request = generator.request(&input, &persona);
                let mutations = match generator.rng.below(10) {
                    _ if warm_up => 0,
                    0..=2 => 0,
                    3..=8 => 1 + generator.rng.below(3),
                    _ => 8,
                };
                for _ in 0..mutations {
                    generator.mutate(&mut request, &persona, 0);
                }
                mutated += mutations;
                let mut body = encode(&request);
                if !warm_up && generator.rng.percent(5) {
                    let (corrupted, how) = corrupt(&mut generator.rng, body);
                    body = corrupted;
                    notes.push(how);
                }
                bodies.push(Bytes::from(body));
                requests.push(request);
            }
            // Now and then a unary RPC gets no message, or two.
            if !warm_up && rpc.shape != Shape::Bidi && generator.rng.percent(2) {
                if generator.rng.percent(50) {
                    bodies.clear();
                    notes.push("no request message");
                } else {
                    bodies.push(bodies[0].clone());
                    notes.push("two request messages");
                }
            }
            let answer = call(&channel, rpc, bodies).await;
            let mut statuses: Vec<&Answered> = answer.statuses.iter().collect();
            let in_band: Vec<Answered> =
                answer.responses.iter().filter_map(|r| in_band_errors(rpc, &pool, r)).collect();
            statuses.extend(in_band.iter());

            if verbose {
                let first =
                    statuses.first().map(|s| format!("{:?} {}", s.code, anima_engine::validate::echo(&s.message)));
                println!(
                    "case {case} {} ({mutated} mutations {notes:?}): {}",
                    rpc.path,
                    first.unwrap_or_else(|| "OK".into())
                );
            }
            let mut long = Vec::new();
            requests.iter().for_each(|r| long_values(r, &mut long));
            let mut problems: Vec<String> = statuses.iter().filter_map(|s| judge(rpc, &input, &long, s)).collect();
            library_quotes += statuses
                .iter()
                .filter(|s| rpc.owner == Owner::Library && s.message.len() > STATUS_MESSAGE_BYTES_MAX)
                .count();
            if let Some(what) = answer.hung {
                problems.push(format!("{what} did not come within {CALL_TIME_MAX:?}"));
            }
            if !problems.is_empty() {
                let shown: Vec<String> = requests.iter().map(describe).collect();
                failures.push(format!(
                    "case {case} {}{}: {}\n    request: {}",
                    rpc.path,
                    if notes.is_empty() { String::new() } else { format!(" ({})", notes.join(", ")) },
                    problems.join("; "),
                    shown.join("\n             ")
                ));
            }

            let entry = seen.entry(rpc.path).or_default();
            entry.calls += 1;
            entry.slowest = entry.slowest.max(answer.elapsed);
            if answer.ok() && in_band.is_empty() {
                entry.accepted += 1;
                *entry.codes.entry("OK".into()).or_default() += 1;
            } else if answer.ok() {
                // A stream that answered some items and refused others.
                if in_band.len() < answer.responses.len() {
                    entry.accepted += 1;
                }
            }
            for status in &statuses {
                entry.refused += 1;
                *entry.codes.entry(format!("{:?}", status.code)).or_default() += 1;
            }
            if answer.ok() {
                for request in &requests {
                    generator.known.learn(rpc, request, &answer.responses);
                }
            }
        }
    }
    let elapsed = started.elapsed();

    println!("{:<64} {:>5} {:>5} {:>5} {:>7}  codes", "rpc", "calls", "ok", "refus", "slowest");
    for (path, s) in &seen {
        let codes: Vec<String> = s.codes.iter().map(|(code, n)| format!("{code} {n}")).collect();
        println!(
            "{path:<64} {:>5} {:>5} {:>5} {:>5}ms  {}",
            s.calls,
            s.accepted,
            s.refused,
            s.slowest.as_millis(),
            codes.join(", ")
        );
    }
    println!(
        "{case} calls in {:.1} s; {} failed; {library_quotes} answers of tonic's reflection over {STATUS_MESSAGE_BYTES_MAX} bytes (not checked)",
        elapsed.as_secs_f64(),
        failures.len()
    );

    let mut wrong = Vec::new();
    if !failures.is_empty() {
        let shown = failures.iter().take(FAILURES_SHOWN_MAX).cloned().collect::<Vec<_>>().join("\n");
        wrong.push(format!("{} of {case} calls got a bad answer:\n{shown}", failures.len()));
    }
    // Both paths ran: each API RPC accepted something and refused something.
    for rpc in RPCS.iter().filter(|r| r.owner == Owner::Api) {
        let s = &seen[rpc.path];
        if s.accepted == 0 || s.refused == 0 {
            wrong.push(format!(
                "{} was accepted {} and refused {} times: give its fields valid-looking and hostile values",
                rpc.path, s.accepted, s.refused
            ));
        }
    }
    let panicked = panics.lock().unwrap().clone();
    if !panicked.is_empty() {
        wrong.push(format!("the server panicked {} times:\n{}", panicked.len(), panicked.join("\n")));
    }
    still_serving(&channel, &mut wrong).await;
    let shutdown = tokio::time::timeout(Duration::from_secs(30), server.shutdown()).await;
    match shutdown {
        Ok(Ok(())) => {}
        Ok(Err(e)) => wrong.push(format!("the server did not shut down cleanly: {e:#}")),
        Err(_) => wrong.push("the server did not shut down within 30 s".into()),
    }
    assert!(
        wrong.is_empty(),
        "seed {seed} (ANIMA_FUZZ_SEED={seed} ANIMA_FUZZ_CASES={cases} reruns it):\n{}",
        wrong.join("\n")
    );
}

/// The services the server lists through reflection (v1).
async fn list_services(channel: &Channel) -> BTreeSet<String> {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let mut reflection = ServerReflectionClient::new(channel.clone());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut request = tonic::Request::new(futures::stream::iter(vec![request]));
    request.metadata_mut().insert("authorization", format!("Bearer {ADMIN_TOKEN}").parse().expect("ascii"));
    let mut answers = reflection.server_reflection_info(request).await.expect("reflection answers").into_inner();
    let answer = answers.message().await.expect("a reflection answer").expect("one answer");
    match answer.message_response {
        Some(MessageResponse::ListServicesResponse(list)) => list.service.into_iter().map(|s| s.name).collect(),
        other => panic!("ListServices answered {other:?}"),
    }
}

/// After the run: health SERVING for every service, and a plain request still answered.
async fn still_serving(channel: &Channel, wrong: &mut Vec<String>) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut health = HealthClient::new(channel.clone());
    let services = [
        "",
        "anima.v1.Ingest",
        "anima.v1.Wakes",
        "anima.v1.Sends",
        "anima.v1.Subscriptions",
        "anima.v1.Memory",
        "anima.v1.Replay",
        "anima.v1.Analytics",
    ];
    for service in services {
        match health.check(HealthCheckRequest { service: service.into() }).await {
            Ok(answer) if answer.get_ref().status() == ServingStatus::Serving => {}
            other => wrong.push(format!("health of {service:?} after the run: {other:?}")),
        }
    }
    let mut ingest = api::ingest_client::IngestClient::with_interceptor(channel.clone(), admin);
    let message = api::SlackMessage {
        receiving_agent_ids: vec!["ada".into()],
        kind: api::SlackDeliveryKind::Message as i32,
        team_id: "T1".into(),
        channel_id: "DAFTER".into(),
        ts: "1800000000.000100".into(),
        user_id: "U1".into(),
        text: "still there?".into(),
        ..Default::default()
    };
    let append = api::AppendRequest {
        correlation_id: "after".into(),
        observation: Some(api::append_request::Observation::SlackMessage(message)),
    };
    if let Err(status) = ingest.append(append).await {
        wrong.push(format!("a valid Append after the run: {status:?}"));
    }
    let mut memory = api::memory_client::MemoryClient::with_interceptor(channel.clone(), admin);
    if let Err(status) = memory.status(api::MemoryStatusRequest { agent_id: "ada".into() }).await {
        wrong.push(format!("a valid Memory.Status after the run: {status:?}"));
    }
}
