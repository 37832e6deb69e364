//! Command handlers: validate the input, append the request (or observation) to the log with an
//! id fixed before the first attempt, wait until the fold has applied it, and return the verdict
//! the fold recorded at that position. Nothing here decides; rendering of notices and
//! wake texts happens here only because it needs bodies read from the cache or the log.

use std::sync::Arc;
use std::time::Duration;

use anima_projections::journal::{RowBody, RowMeta};
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::state::Halt;
use anima_projections::surface::{
    chat_message_identity, linear_receipt_identity, slack_message_identity, LinearReceiptKind, SurfaceId,
};
use anima_projections::verdict::{
    ClaimVerdict, ClaimedWake, JournalVerdict, LinearResponseVerdict, LinearSessionVerdict, Refusal, RefusalKind,
    SendVerdict, Verdict,
};
use anima_projections::{render, text};
use bytes::Bytes;
use prost::Message;
use uuid::Uuid;

use crate::clock::{Clock, SystemClock};
use crate::log::{AppendOutcome, AppendRecord, EventLog, LogError};
use crate::projection::Projection;
use crate::recent_verdicts::Recent;
use crate::subject::Subjects;
use crate::validate::{self, invalid};

/// Namespace of the engine's derived (UUID v5) event ids.
pub(crate) const EVENT_ID_NAMESPACE: Uuid = Uuid::from_u128(0x5d0c_7a4e_2b1f_4c8e_9a37_61f0_c4d2_aa01);

/// Errors of commands, each saying what the client should do. The gateway maps them to gRPC
/// status codes in one place.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Fix the named field. Nothing was appended.
    #[error("{field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    /// The named field is over its size bound. Nothing was appended.
    #[error("{field}: too large: {reason}")]
    TooLarge { field: &'static str, reason: String },
    /// The fold refused the request at its place in the log.
    #[error("{}", .0.message)]
    Refused(Refusal),
    /// The log is down or slow; retry with the same request id.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Fail closed: the store is inconsistent, the fold stopped, or the verdict is gone.
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
}

impl From<LogError> for CommandError {
    fn from(error: LogError) -> Self {
        match error {
            LogError::Unavailable(m) => CommandError::Unavailable(m),
            LogError::Store(m) => CommandError::FailedPrecondition(format!("event log: {m}")),
            LogError::Invalid(m) => CommandError::InvalidArgument { field: "event", reason: m },
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// How long a handler waits for the fold to apply its request.
    pub verdict_wait: Duration,
    /// Source name stamped on appended envelopes.
    pub source: String,
    /// How long a claim may wait for its start (log time; a heartbeat extends it), carried in
    /// every claim request so the fold judges it with the log's time (`[wakes]
    /// claim_lease_seconds`, default 300 s). Whole seconds, 1 s up to a day.
    pub claim_lease: Duration,
    /// "Now" outside the log: the heartbeat rate limit and the recovery loop's candidates. The
    /// instance sets its own clock here.
    pub clock: Arc<dyn Clock>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            verdict_wait: Duration::from_secs(10),
            source: "anima-wake".into(),
            claim_lease: Duration::from_secs(u64::from(anima_projections::wake::CLAIM_LEASE_DEFAULT_SECONDS)),
            clock: Arc::new(SystemClock),
        }
    }
}

impl EngineConfig {
    /// The claim lease in whole seconds, within the bounds the fold accepts.
    pub fn claim_lease_seconds(&self) -> u32 {
        let seconds = u32::try_from(self.claim_lease.as_secs()).unwrap_or(u32::MAX);
        seconds.clamp(1, anima_projections::wake::CLAIM_LEASE_MAX_SECONDS)
    }
}

/// The command side of one engine instance.
#[derive(Clone)]
pub struct Engine {
    log: Arc<dyn EventLog>,
    projection: Arc<Projection>,
    config: EngineConfig,
    /// When this instance last appended a heartbeat per (agent, item), by its clock (unix ns), to
    /// append at most one a minute. Bounded: entries older than the interval are dropped when it
    /// grows.
    heartbeats: Arc<std::sync::Mutex<std::collections::BTreeMap<(String, String), i64>>>,
}

/// Heartbeats appended per item at most this often; more frequent ones are acknowledged only.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(60);
/// Heartbeat entries remembered before old ones are dropped.
const HEARTBEATS_REMEMBERED_MAX: usize = 100_000;

/// A Slack observation as a connector reports it: the message and every agent that received it.
#[derive(Clone, Debug)]
pub struct SlackObservation {
    pub receiving_agent_ids: Vec<String>,
    /// The message; its `receiving_agent_id` is ignored and set per receiver.
    pub message: proto::SlackMessageObserved,
    pub occurred_at_ms: i64,
}

/// A chat observation as a connector reports it: the message and every agent that received it.
#[derive(Clone, Debug)]
pub struct ChatObservation {
    pub receiving_agent_ids: Vec<String>,
    /// The message; its `receiving_agent_id` is ignored and set per receiver.
    pub message: proto::ChatMessageObserved,
    pub occurred_at_ms: i64,
}

/// A Linear agent-session event as a connector reports it (its `receiving_agent_id` names the
/// agent whose app received it).
#[derive(Clone, Debug)]
pub struct LinearObservation {
    pub event: proto::LinearSessionEvent,
    pub occurred_at_ms: i64,
}

/// What one appended Linear session event became.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearIngestOutcome {
    pub seq: u64,
    pub duplicate_event: bool,
    pub verdict: LinearSessionVerdict,
}

/// What a Slack thread stop did.
#[derive(Clone, Debug)]
pub struct ThreadStopOutcome {
    pub seq: u64,
    pub duplicate_event: bool,
    pub verdict: anima_projections::thread_stop::ThreadStopVerdict,
}

/// A Linear response request or outcome as the fold decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearResponseDecision {
    pub seq: u64,
    pub verdict: LinearResponseVerdict,
}

/// What one appended observation became.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IngestOutcome {
    pub agent: String,
    pub seq: u64,
    pub duplicate_event: bool,
    pub journal: JournalVerdict,
}

#[derive(Clone, Debug)]
pub struct SendDecision {
    pub seq: u64,
    pub verdict: SendVerdict,
    /// The notice to show when held.
    pub notice: Option<String>,
    /// A repeated request whose allowed post was confirmed since: the post. Do not post again.
    pub already_posted: Option<anima_projections::send_hold::PostedSend>,
}

#[derive(Clone, Debug)]
pub struct FinishOutcome {
    pub seq: u64,
    /// A restart drain: the item is queued again.
    pub requeued: bool,
    /// For a memory pass that did not drain: the outcome the fold recorded.
    pub memory_outcome: Option<anima_projections::memory::MemoryOutcomeRecord>,
}

#[derive(Clone, Debug)]
pub struct ClaimOutcome {
    pub seq: u64,
    pub wake: Option<ClaimedWakeText>,
    pub settled_without_turn: Vec<String>,
}

#[derive(Clone, Debug)]
pub struct ClaimedWakeText {
    pub claimed: ClaimedWake,
    pub text: String,
}

impl Engine {
    pub fn new(log: Arc<dyn EventLog>, projection: Arc<Projection>, config: EngineConfig) -> Self {
        Engine { log, projection, config, heartbeats: Arc::default() }
    }

    pub fn projection(&self) -> &Arc<Projection> {
        &self.projection
    }

    pub fn log(&self) -> &Arc<dyn EventLog> {
        &self.log
    }

    /// The subjects of this engine's log: every append builds its subject with these.
    pub fn subjects(&self) -> &Subjects {
        self.log.subjects()
    }

    pub(crate) fn envelope(&self, event_id: String, occurred_at_ms: i64, payload: Payload) -> proto::Envelope {
        proto::Envelope {
            event_id,
            occurred_at_ms,
            min_reader_version: 1,
            source: self.config.source.clone(),
            payload: Some(payload),
        }
    }

    fn record(subject: String, envelope: &proto::Envelope) -> AppendRecord {
        AppendRecord { subject, msg_id: envelope.event_id.clone(), payload: Bytes::from(envelope.encode_to_vec()) }
    }

    /// Waits for the fold to apply `seq` and returns its verdict.
    async fn verdict_at(&self, seq: u64) -> Result<Verdict, CommandError> {
        self.projection
            .wait_applied(seq, self.config.verdict_wait)
            .await
            .map_err(|e| CommandError::Unavailable(e.to_string()))?;
        // Without the state lock when the verdict is recent, as it is for nearly every request:
        // the fold may be holding the lock through its next batch.
        match self.projection.recent_verdict(seq) {
            Recent::Halted(halt) => answer(seq, Some(&halt), None),
            Recent::Verdict(kept) => answer(seq, None, kept.get()),
            Recent::NoVerdict => answer(seq, None, None),
            Recent::NotKept => {
                let state = self.projection.state();
                answer(seq, state.halted_at_or_before(seq), state.verdict(seq))
            }
        }
    }

    pub(crate) async fn append_and_decide(
        &self,
        subject: String,
        envelope: &proto::Envelope,
    ) -> Result<(AppendOutcome, Verdict), CommandError> {
        let outcome = self.log.append(Self::record(subject, envelope)).await?;
        if outcome.is_duplicate() {
            self.require_same_kind(outcome.seq(), envelope).await?;
        }
        let verdict = self.verdict_at(outcome.seq()).await?;
        Ok((outcome, verdict))
    }

    /// The event at `seq` carries the same kind of request as `envelope`, whose id it has. Ids
    /// derived from content differ by kind, so only a client's `request_id` used for one RPC and
    /// then for another collides across kinds: that is the client's mistake, not a retry, and it
    /// must neither get the other request's verdict nor a mismatch that reads like a server bug.
    async fn require_same_kind(&self, seq: u64, envelope: &proto::Envelope) -> Result<(), CommandError> {
        let Some(stored) = self.log.get(seq).await? else { return Ok(()) };
        let stored = proto::Envelope::decode(stored.payload.as_ref()).ok().and_then(|e| e.payload);
        match (stored, envelope.payload.as_ref()) {
            (Some(stored), Some(ours)) if std::mem::discriminant(&stored) != std::mem::discriminant(ours) => {
                Err(invalid(
                    "request_id",
                    format!(
                        "{} was already used for another kind of request; send a new UUID",
                        validate::echo(&envelope.event_id)
                    ),
                ))
            }
            // Another agent's request under the same id: its verdict (a held notice shows that
            // agent's conversation) must not reach this caller. Content-derived ids include the
            // agent, so only a client's request_id can collide so.
            (Some(stored), Some(ours)) if request_agent(&stored) != request_agent(ours) => Err(invalid(
                "request_id",
                format!(
                    "{} was already used for another agent's request; send a new UUID",
                    validate::echo(&envelope.event_id)
                ),
            )),
            // The same kind (a retry), or a payload this build cannot read: the verdict decides.
            _ => Ok(()),
        }
    }

    pub(crate) fn require_agent(&self, field: &'static str, agent: &str) -> Result<(), CommandError> {
        validate::id(field, agent)?;
        if self.projection.is_registered(agent) {
            Ok(())
        } else {
            Err(invalid(field, format!("unknown agent {}", validate::echo(agent))))
        }
    }

    fn request_event_id(request_id: &str) -> Result<String, CommandError> {
        Ok(validate::request_id(request_id)?.unwrap_or_else(Uuid::now_v7).to_string())
    }

    /// Registers (or re-registers) an agent with its Slack identities.
    pub async fn register_agent(&self, registration: proto::AgentRegistered) -> Result<u64, CommandError> {
        validate::id("agent_id", &registration.agent_id)?;
        validate::slack_id("slack_bot_user_id", &registration.slack_bot_user_id, false)?;
        validate::slack_id("slack_bot_id", &registration.slack_bot_id, false)?;
        validate::bounded("display_name", &registration.display_name, validate::USER_NAME_BYTES_MAX)?;
        validate::chat_id("chat_user_id", &registration.chat_user_id, false)?;
        // Same registration content, same id: instances starting with one config dedupe.
        let event_id =
            Uuid::new_v5(&EVENT_ID_NAMESPACE, &[b"agent\0".as_slice(), &registration.encode_to_vec()].concat());
        let envelope = self.envelope(event_id.to_string(), 0, Payload::AgentRegistered(registration.clone()));
        let (outcome, _) = self.append_and_decide(self.subjects().agent(&registration.agent_id), &envelope).await?;
        Ok(outcome.seq())
    }

    /// Appends the agents of the configuration that the log does not hold as configured.
    /// Returns how many were appended.
    pub async fn sync_agents(&self, configured: &[proto::AgentRegistered]) -> Result<usize, CommandError> {
        let mut appended = 0;
        for registration in configured {
            let current = self.projection.state().agents.get(&registration.agent_id).cloned();
            let same = current.is_some_and(|c| {
                c.slack_bot_user_id == registration.slack_bot_user_id
                    && c.slack_bot_id == registration.slack_bot_id
                    && c.display_name == registration.display_name
                    && c.chat_user_id == registration.chat_user_id
            });
            if !same {
                self.register_agent(registration.clone()).await?;
                appended += 1;
            }
        }
        Ok(appended)
    }

    /// Appends one event per receiving agent, with ids derived from (identity, delivery kind,
    /// receiver) so connector retries dedupe in the log.
    pub async fn ingest_slack(&self, observation: SlackObservation) -> Result<Vec<IngestOutcome>, CommandError> {
        let message = &observation.message;
        self.check_receivers(&observation.receiving_agent_ids)?;
        let kind = proto::SlackDeliveryKind::try_from(message.kind)
            .ok()
            .filter(|k| *k != proto::SlackDeliveryKind::Unspecified)
            .ok_or_else(|| invalid("kind", "must be MESSAGE or APP_MENTION"))?;
        validate::slack_id("team_id", &message.team_id, true)?;
        validate::slack_id("channel_id", &message.channel_id, true)?;
        validate::slack_ts("ts", &message.ts, true)?;
        validate::slack_ts("thread_ts", &message.thread_ts, false)?;
        validate::slack_id("user_id", &message.user_id, false)?;
        validate::slack_id("bot_id", &message.bot_id, false)?;
        validate::bounded("subtype", &message.subtype, validate::SLACK_SUBTYPE_BYTES_MAX)?;
        validate::slack_text("text", &message.text)?;
        validate::bounded("user_name", &message.user_name, validate::USER_NAME_BYTES_MAX)?;
        validate::files("files", &message.files)?;
        validate::previews("previews", &message.previews)?;

        let identity = slack_message_identity(&message.team_id, &message.channel_id, &message.ts);
        let surface = SurfaceId::slack_message(&message.team_id, &message.channel_id, &message.ts, &message.thread_ts);
        let subject = self.subjects().surface(&surface);
        let mut records = Vec::with_capacity(observation.receiving_agent_ids.len());
        for agent in &observation.receiving_agent_ids {
            let key = format!("slack-message\0{identity}\0{}\0{agent}", kind.as_str_name());
            let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
            let observed = proto::SlackMessageObserved { receiving_agent_id: agent.clone(), ..message.clone() };
            let envelope = self.envelope(event_id, observation.occurred_at_ms, Payload::SlackMessage(observed));
            records.push((agent.clone(), Self::record(subject.clone(), &envelope)));
        }
        self.append_observations(records).await
    }

    fn check_receivers(&self, receiving_agent_ids: &[String]) -> Result<(), CommandError> {
        if receiving_agent_ids.is_empty() {
            return Err(invalid("receiving_agent_ids", "must name at least one agent"));
        }
        if receiving_agent_ids.len() > validate::RECEIVERS_MAX {
            return Err(CommandError::TooLarge {
                field: "receiving_agent_ids",
                reason: format!("at most {}", validate::RECEIVERS_MAX),
            });
        }
        for agent in receiving_agent_ids {
            self.require_agent("receiving_agent_ids", agent)?;
        }
        Ok(())
    }

    /// Appends one observation per receiving agent (pipelined when there are several) and waits
    /// for the fold's journal verdict of each.
    async fn append_observations(
        &self,
        records: Vec<(String, AppendRecord)>,
    ) -> Result<Vec<IngestOutcome>, CommandError> {
        let outcomes = if records.len() == 1 {
            vec![self.log.append(records[0].1.clone()).await?]
        } else {
            self.log.append_batch(records.iter().map(|(_, r)| r.clone()).collect()).await?
        };
        let mut results = Vec::with_capacity(outcomes.len());
        for ((agent, _), outcome) in records.into_iter().zip(outcomes) {
            let journal = match self.verdict_at(outcome.seq()).await? {
                Verdict::Journaled(journal) => journal,
                other => return Err(unexpected(other)),
            };
            results.push(IngestOutcome { agent, seq: outcome.seq(), duplicate_event: outcome.is_duplicate(), journal });
        }
        Ok(results)
    }

    /// Appends one chat observation per receiving agent, with ids derived from (identity,
    /// receiver) so connector retries dedupe in the log.
    pub async fn ingest_chat(&self, observation: ChatObservation) -> Result<Vec<IngestOutcome>, CommandError> {
        let message = &observation.message;
        self.check_receivers(&observation.receiving_agent_ids)?;
        validate::chat_id("tenant_id", &message.tenant_id, true)?;
        validate::chat_id("chat_id", &message.chat_id, true)?;
        if anima_projections::surface::ChatKind::from_proto(message.chat_kind).is_none() {
            return Err(invalid("chat_kind", "must be P2P or GROUP"));
        }
        validate::chat_id("message_id", &message.message_id, true)?;
        validate::chat_id("thread_id", &message.thread_id, false)?;
        validate::chat_id("sender_id", &message.sender_id, true)?;
        validate::bounded("sender_name", &message.sender_name, validate::USER_NAME_BYTES_MAX)?;
        validate::slack_text("text", &message.text)?;
        validate::files("files", &message.files)?;
        if message.mentioned_user_ids.len() > validate::CHAT_MENTIONS_MAX {
            return Err(CommandError::TooLarge {
                field: "mentioned_user_ids",
                reason: format!("{} ids; at most {}", message.mentioned_user_ids.len(), validate::CHAT_MENTIONS_MAX),
            });
        }
        for user in &message.mentioned_user_ids {
            validate::chat_id("mentioned_user_ids", user, true)?;
        }

        let identity = chat_message_identity(&message.tenant_id, &message.chat_id, &message.message_id);
        let surface =
            SurfaceId::chat_message(&message.tenant_id, &message.chat_id, &message.message_id, &message.thread_id);
        let subject = self.subjects().surface(&surface);
        let mut records = Vec::with_capacity(observation.receiving_agent_ids.len());
        for agent in &observation.receiving_agent_ids {
            let key = format!("chat-message\0{identity}\0{agent}");
            let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
            let observed = proto::ChatMessageObserved { receiving_agent_id: agent.clone(), ..message.clone() };
            let envelope = self.envelope(event_id, observation.occurred_at_ms, Payload::ChatMessage(observed));
            records.push((agent.clone(), Self::record(subject.clone(), &envelope)));
        }
        self.append_observations(records).await
    }

    /// Appends a Linear session event. Created and prompted events get ids derived from their
    /// receipt identity and receiver, so connector retries dedupe in the log (and the fold keeps
    /// the first receipt); a stop's id is derived from the session, receiver and source time.
    pub async fn ingest_linear(&self, observation: LinearObservation) -> Result<LinearIngestOutcome, CommandError> {
        let event = &observation.event;
        self.require_agent("receiving_agent_id", &event.receiving_agent_id)?;
        validate::chat_id("installation_id", &event.installation_id, true)?;
        validate::linear_session_id("session_id", &event.session_id)?;
        let kind = proto::LinearSessionEventKind::try_from(event.kind)
            .ok()
            .filter(|k| *k != proto::LinearSessionEventKind::Unspecified)
            .ok_or_else(|| invalid("kind", "must be CREATED, PROMPTED or STOP"))?;
        let prompted = kind == proto::LinearSessionEventKind::Prompted;
        validate::chat_id("agent_activity_id", &event.agent_activity_id, prompted)?;
        validate::bounded("agent_activity_id", &event.agent_activity_id, validate::LINEAR_ID_BYTES_MAX)?;
        validate::bounded("issue_identifier", &event.issue_identifier, validate::LINEAR_ID_BYTES_MAX)?;
        validate::bounded("issue_url", &event.issue_url, validate::LINEAR_URL_BYTES_MAX)?;
        validate::bounded("issue_title", &event.issue_title, validate::LINEAR_TITLE_BYTES_MAX)?;
        validate::linear_text("prompt_text", &event.prompt_text)?;
        let agent = &event.receiving_agent_id;
        let key = match kind {
            proto::LinearSessionEventKind::Created => {
                let receipt =
                    linear_receipt_identity(&event.installation_id, LinearReceiptKind::Created, &event.session_id);
                format!("linear-session\0{receipt}\0{agent}")
            }
            proto::LinearSessionEventKind::Prompted => {
                let receipt = linear_receipt_identity(
                    &event.installation_id,
                    LinearReceiptKind::Prompted,
                    &event.agent_activity_id,
                );
                format!("linear-session\0{receipt}\0{agent}")
            }
            _ => format!(
                "linear-stop\0{}\0{}\0{agent}\0{}",
                event.installation_id, event.session_id, observation.occurred_at_ms
            ),
        };
        let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
        let envelope = self.envelope(event_id, observation.occurred_at_ms, Payload::LinearSession(event.clone()));
        let subject = self.subjects().linear_session(&event.session_id);
        let (outcome, verdict) = self.append_and_decide(subject, &envelope).await?;
        let Verdict::LinearSession(verdict) = verdict else { return Err(unexpected(verdict)) };
        Ok(LinearIngestOutcome { seq: outcome.seq(), duplicate_event: outcome.is_duplicate(), verdict })
    }

    /// The user stopped the agent in a Slack thread: the thread's queued input for that agent
    /// is removed. `occurred_at_ms` (required) tells two stops of one thread apart, so a
    /// connector's retry of one stop is deduped and never removes input queued after it.
    pub async fn stop_slack_thread(
        &self,
        stop: proto::SlackThreadStopObserved,
        occurred_at_ms: i64,
    ) -> Result<ThreadStopOutcome, CommandError> {
        self.require_agent("receiving_agent_id", &stop.receiving_agent_id)?;
        validate::slack_id("team_id", &stop.team_id, true)?;
        validate::slack_id("channel_id", &stop.channel_id, true)?;
        validate::slack_ts("thread_ts", &stop.thread_ts, true)?;
        if occurred_at_ms <= 0 {
            return Err(invalid("occurred_at_ms", "is required for a stop (unix milliseconds of the stop)"));
        }
        let surface = SurfaceId::Slack {
            team: stop.team_id.as_str().into(),
            channel: stop.channel_id.as_str().into(),
            thread_ts: Some(stop.thread_ts.as_str().into()),
        };
        let key = format!("slack-thread-stop\0{surface}\0{}\0{occurred_at_ms}", stop.receiving_agent_id);
        let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
        let envelope = self.envelope(event_id, occurred_at_ms, Payload::SlackThreadStop(stop));
        let (outcome, verdict) = self.append_and_decide(self.subjects().surface(&surface), &envelope).await?;
        let Verdict::ThreadStopped(verdict) = verdict else { return Err(unexpected(verdict)) };
        Ok(ThreadStopOutcome { seq: outcome.seq(), duplicate_event: outcome.is_duplicate(), verdict })
    }

    /// Asks to answer a Linear session: returns the activity id the fold generated
    /// for this response's key (the earlier one for a repeat) and its state.
    pub async fn respond_linear(
        &self,
        request: proto::LinearResponseRequested,
        request_id: &str,
    ) -> Result<LinearResponseDecision, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        validate::linear_session_id("session_id", &request.session_id)?;
        proto::LinearResponseKind::try_from(request.kind)
            .ok()
            .filter(|k| *k != proto::LinearResponseKind::Unspecified)
            .ok_or_else(|| invalid("kind", "must be THOUGHT, ACTION, ELICITATION, RESPONSE or ERROR"))?;
        validate::linear_text("body", &request.body)?;
        if request.input_ids.len() > anima_projections::linear::LINEAR_RESPONSE_INPUTS_MAX {
            return Err(CommandError::TooLarge {
                field: "input_ids",
                reason: format!(
                    "{} ids; at most {}",
                    request.input_ids.len(),
                    anima_projections::linear::LINEAR_RESPONSE_INPUTS_MAX
                ),
            });
        }
        for input in &request.input_ids {
            validate::bounded("input_ids", input, validate::ITEM_ID_BYTES_MAX)?;
            if input.is_empty() {
                return Err(invalid("input_ids", "must not hold an empty id"));
            }
        }
        let event_id = Self::request_event_id(request_id)?;
        let envelope = self.envelope(event_id, 0, Payload::LinearResponse(request.clone()));
        let subject = self.subjects().linear_session(&request.session_id);
        let (outcome, verdict) = self.append_and_decide(subject, &envelope).await?;
        let Verdict::LinearResponse(verdict) = verdict else { return Err(unexpected(verdict)) };
        Ok(LinearResponseDecision { seq: outcome.seq(), verdict })
    }

    /// Records what became of a Linear response the runtime sent: accepted or unknown.
    pub async fn confirm_linear_response(
        &self,
        outcome: proto::LinearResponseOutcome,
        request_id: &str,
    ) -> Result<LinearResponseDecision, CommandError> {
        self.require_agent("agent_id", &outcome.agent_id)?;
        validate::linear_session_id("activity_id", &outcome.activity_id)?;
        proto::LinearResponseResult::try_from(outcome.result)
            .ok()
            .filter(|r| *r != proto::LinearResponseResult::Unspecified)
            .ok_or_else(|| invalid("result", "must be ACCEPTED or UNKNOWN"))?;
        let event_id = Self::request_event_id(request_id)?;
        let envelope = self.envelope(event_id, 0, Payload::LinearResponseOutcome(outcome.clone()));
        let (appended, verdict) = self.append_and_decide(self.subjects().agent(&outcome.agent_id), &envelope).await?;
        let Verdict::LinearResponse(verdict) = verdict else { return Err(unexpected(verdict)) };
        Ok(LinearResponseDecision { seq: appended.seq(), verdict })
    }

    fn target_surface(target: Option<&proto::ReplyTarget>) -> Result<SurfaceId, CommandError> {
        let Some(reply_target @ proto::ReplyTarget { target: Some(inner) }) = target else {
            return Err(invalid("target", "must be a Slack or a chat target"));
        };
        match inner {
            proto::reply_target::Target::Slack(slack) => {
                validate::slack_id("target.team_id", &slack.team_id, true)?;
                validate::slack_id("target.channel_id", &slack.channel_id, true)?;
                validate::slack_ts("target.thread_ts", &slack.thread_ts, false)?;
            }
            proto::reply_target::Target::Chat(chat) => {
                validate::chat_id("target.tenant_id", &chat.tenant_id, true)?;
                validate::chat_id("target.chat_id", &chat.chat_id, true)?;
                validate::chat_id("target.thread_id", &chat.thread_id, false)?;
            }
            proto::reply_target::Target::Linear(linear) => {
                validate::linear_session_id("target.session_id", &linear.session_id)?;
            }
        }
        SurfaceId::from_target(reply_target).ok_or_else(|| invalid("target", "is empty"))
    }

    fn send_kind(kind: i32) -> Result<proto::SendKind, CommandError> {
        proto::SendKind::try_from(kind)
            .ok()
            .filter(|k| *k != proto::SendKind::Unspecified)
            .ok_or_else(|| invalid("kind", "must be MESSAGE, ASK or FILE"))
    }

    /// Asks before a post; returns the fold's verdict at the request's place in the log, with the
    /// rendered notice when held.
    pub async fn send(&self, request: proto::SendRequested, request_id: &str) -> Result<SendDecision, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        let surface = Self::target_surface(request.target.as_ref())?;
        if matches!(surface, SurfaceId::Linear { .. }) {
            return Err(invalid("target", "a Linear session is answered with Sends.Respond, not Send"));
        }
        Self::send_kind(request.kind)?;
        if request.mentioned_user_ids.len() > anima_projections::do_not_contact::MENTIONS_MAX {
            return Err(CommandError::TooLarge {
                field: "mentioned_user_ids",
                reason: format!(
                    "{} ids, more than {}",
                    request.mentioned_user_ids.len(),
                    anima_projections::do_not_contact::MENTIONS_MAX
                ),
            });
        }
        for user in &request.mentioned_user_ids {
            validate::chat_id("mentioned_user_ids", user, true)?;
        }
        let event_id = Self::request_event_id(request_id)?;
        let envelope = self.envelope(event_id, 0, Payload::Send(request.clone()));
        let subject = self.subjects().surface(&surface);
        let (outcome, verdict) = self.append_and_decide(subject, &envelope).await?;
        let Verdict::Send(verdict) = verdict else { return Err(unexpected(verdict)) };
        if outcome.is_duplicate() && matches!(verdict, SendVerdict::Allowed { .. }) {
            let posted = self.posted_since(&envelope.event_id, &request.agent_id, &surface).await?;
            if posted.is_some() {
                return Ok(SendDecision { seq: outcome.seq(), verdict, notice: None, already_posted: posted });
            }
        }
        let notice = match &verdict {
            SendVerdict::Allowed { .. } | SendVerdict::NotContacted(_) => None,
            SendVerdict::Held(held) => {
                let bodies = self.row_bodies(&held.shown).await?;
                let rows: Vec<(&RowMeta, &RowBody)> =
                    held.shown.iter().zip(bodies.iter().map(|b| b.as_ref())).collect();
                Some(text::render_held_notice(&request.agent_id, held.kind, held.new_messages, held.omitted, &rows))
            }
        };
        Ok(SendDecision { seq: outcome.seq(), verdict, notice, already_posted: None })
    }

    /// The post confirmed for an earlier allowed send of this agent on this surface, as the log
    /// holds it now: the projection is brought up to the log's end first, so a confirmation that
    /// reached the log before this retry is seen whichever instance took it. A read of what
    /// happened, not a decision: the send's verdict stays the one the fold recorded.
    async fn posted_since(
        &self,
        send_event_id: &str,
        agent: &str,
        surface: &SurfaceId,
    ) -> Result<Option<anima_projections::send_hold::PostedSend>, CommandError> {
        let end = self.log.last_seq().await?;
        self.projection
            .wait_applied(end, self.config.verdict_wait)
            .await
            .map_err(|e| CommandError::Unavailable(e.to_string()))?;
        let state = self.projection.state();
        Ok(state.posted_send(send_event_id).filter(|p| p.agent == agent && &p.surface == surface).cloned())
    }

    async fn row_bodies(&self, rows: &[RowMeta]) -> Result<Vec<Arc<RowBody>>, CommandError> {
        let seqs: Vec<u64> = rows.iter().map(|r| r.seq).collect();
        let bodies = self.projection.bodies(&seqs).await?;
        seqs.iter()
            .map(|seq| {
                bodies
                    .get(seq)
                    .cloned()
                    .ok_or_else(|| CommandError::FailedPrecondition(format!("body of seq {seq} missing")))
            })
            .collect()
    }

    /// Journals the agent's own post.
    /// `send_request_id` names the `Send` that allowed the post (optional, validated like every
    /// request id); a repeat of that send then answers "already posted".
    pub async fn confirm(
        &self,
        mut confirmation: proto::SendConfirmed,
        send_request_id: &str,
    ) -> Result<IngestOutcome, CommandError> {
        self.require_agent("agent_id", &confirmation.agent_id)?;
        confirmation.send_event_id = validate::request_id_named("send_request_id", send_request_id)?
            .map(|id| id.to_string())
            .unwrap_or_default();
        let surface = Self::target_surface(confirmation.target.as_ref())?;
        let kind = Self::send_kind(confirmation.kind)?;
        match surface {
            SurfaceId::Slack { .. } => validate::slack_ts("ts", &confirmation.ts, true)?,
            // The chat platform's message id travels in `ts` (the API's `message_id`).
            SurfaceId::Chat { .. } => validate::chat_id("message_id", &confirmation.ts, true)?,
            SurfaceId::Linear { .. } => {
                return Err(invalid("target", "a Linear response is confirmed with Sends.ConfirmResponse"))
            }
            SurfaceId::Memory { .. } => return Err(invalid("target", "is not a conversation")),
        }
        validate::slack_text("text", &confirmation.text)?;
        validate::files("files", &confirmation.files)?;
        let key = format!("confirm\0{}\0{surface}\0{}\0{}", confirmation.agent_id, confirmation.ts, kind.as_str_name());
        let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
        let envelope = self.envelope(event_id, 0, Payload::SendConfirmed(confirmation.clone()));
        let (outcome, verdict) = self.append_and_decide(self.subjects().surface(&surface), &envelope).await?;
        let Verdict::Journaled(journal) = verdict else { return Err(unexpected(verdict)) };
        Ok(IngestOutcome {
            agent: confirmation.agent_id,
            seq: outcome.seq(),
            duplicate_event: outcome.is_duplicate(),
            journal,
        })
    }

    /// Claims the agent's oldest claimable wake (or a named one) for a worker.
    pub async fn claim(
        &self,
        request: proto::WakeClaimRequested,
        request_id: &str,
    ) -> Result<ClaimOutcome, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        validate::id("worker_id", &request.worker_id)?;
        if !request.item_id.is_empty() {
            validate::bounded("item_id", &request.item_id, validate::ITEM_ID_BYTES_MAX)?;
        }
        let event_id = Self::request_event_id(request_id)?;
        let request = proto::WakeClaimRequested { claim_lease_seconds: self.config.claim_lease_seconds(), ..request };
        let envelope = self.envelope(event_id, 0, Payload::WakeClaim(request.clone()));
        let (outcome, verdict) = self.append_and_decide(self.subjects().agent(&request.agent_id), &envelope).await?;
        match verdict {
            Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn }) => {
                Ok(ClaimOutcome { seq: outcome.seq(), wake: None, settled_without_turn })
            }
            Verdict::Claim(ClaimVerdict::Claimed(claimed)) if claimed.item.memory.is_some() => {
                // A memory pass shows no conversation: nothing to read from the log.
                let text = render::render_wake_text(&request.agent_id, &claimed, &RowBody::default(), &[]);
                let settled_without_turn = claimed.settled_without_turn.clone();
                Ok(ClaimOutcome {
                    seq: outcome.seq(),
                    wake: Some(ClaimedWakeText { claimed: *claimed, text }),
                    settled_without_turn,
                })
            }
            Verdict::Claim(ClaimVerdict::Claimed(claimed)) => {
                let mut rows = claimed.rows.clone();
                rows.push(claimed.item.trigger.clone());
                let bodies = self.row_bodies(&rows).await?;
                let (trigger_body, row_bodies) = bodies.split_last().expect("the trigger was pushed");
                let shown: Vec<(&RowMeta, &RowBody)> =
                    claimed.rows.iter().zip(row_bodies.iter().map(|b| b.as_ref())).collect();
                let text = render::render_wake_text(&request.agent_id, &claimed, trigger_body, &shown);
                let settled_without_turn = claimed.settled_without_turn.clone();
                Ok(ClaimOutcome {
                    seq: outcome.seq(),
                    wake: Some(ClaimedWakeText { claimed: *claimed, text }),
                    settled_without_turn,
                })
            }
            other => Err(unexpected(other)),
        }
    }

    /// Starts a claimed wake with the plan the claim gave; refused (Aborted) when stale.
    pub async fn start(&self, request: proto::WakeStartRequested, request_id: &str) -> Result<u64, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        validate::id("worker_id", &request.worker_id)?;
        validate::bounded("item_id", &request.item_id, validate::ITEM_ID_BYTES_MAX)?;
        // A Linear wake's plan is empty (a session has no journal); the fold accepts only the
        // plan the claim prepared, so an empty plan for any other wake is refused there.
        if request.plan.len() > 16 {
            return Err(invalid("plan", "must hold the 0..=16 surfaces the claim gave"));
        }
        for entry in &request.plan {
            if SurfaceId::parse(&entry.surface).is_none() {
                return Err(invalid(
                    "plan.surface",
                    format!("{} is not a surface key", validate::echo(&entry.surface)),
                ));
            }
        }
        let event_id = Self::request_event_id(request_id)?;
        let envelope = self.envelope(event_id, 0, Payload::WakeStart(request.clone()));
        let (outcome, verdict) = self.append_and_decide(self.subjects().agent(&request.agent_id), &envelope).await?;
        match verdict {
            Verdict::Started { .. } => Ok(outcome.seq()),
            other => Err(unexpected(other)),
        }
    }

    /// Finishes a claimed or running wake.
    pub async fn finish(
        &self,
        request: proto::WakeFinishRequested,
        request_id: &str,
    ) -> Result<FinishOutcome, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        validate::id("worker_id", &request.worker_id)?;
        validate::bounded("item_id", &request.item_id, validate::ITEM_ID_BYTES_MAX)?;
        validate::bounded("reason", &request.reason, validate::REASON_BYTES_MAX)?;
        validate::memory_digest("memory_digest_before", &request.memory_digest_before)?;
        validate::memory_digest("memory_digest_after", &request.memory_digest_after)?;
        match proto::WakeOutcome::try_from(request.outcome) {
            Ok(proto::WakeOutcome::Unspecified) | Err(_) => {
                return Err(invalid("outcome", "must be COMPLETED, FAILED or ABORTED"))
            }
            Ok(proto::WakeOutcome::Aborted) => {}
            Ok(_) if request.restart_drain => {
                return Err(invalid("restart_drain", "only an ABORTED finish can be a restart drain"))
            }
            Ok(_) => {}
        }
        let event_id = Self::request_event_id(request_id)?;
        let envelope = self.envelope(event_id, 0, Payload::WakeFinish(request.clone()));
        let (outcome, verdict) = self.append_and_decide(self.subjects().agent(&request.agent_id), &envelope).await?;
        match verdict {
            Verdict::Finished { requeued, memory_outcome, .. } => {
                Ok(FinishOutcome { seq: outcome.seq(), requeued, memory_outcome: memory_outcome.map(|o| *o) })
            }
            other => Err(unexpected(other)),
        }
    }
}

impl Engine {
    /// Records that the runtime still works on a claimed or running wake (extending a claim's
    /// lease). Returns whether a heartbeat was appended (false: one was appended by this
    /// instance less than a minute ago, by its clock).
    pub async fn heartbeat(&self, request: proto::WakeHeartbeat) -> Result<bool, CommandError> {
        self.require_agent("agent_id", &request.agent_id)?;
        validate::id("worker_id", &request.worker_id)?;
        validate::bounded("item_id", &request.item_id, validate::ITEM_ID_BYTES_MAX)?;
        let key = (request.agent_id.clone(), request.item_id.clone());
        {
            let now_ns = self.config.clock.now_ns();
            let interval_ns = i64::try_from(HEARTBEAT_INTERVAL.as_nanos()).unwrap_or(i64::MAX);
            let recent = |at_ns: &i64| now_ns.saturating_sub(*at_ns) < interval_ns;
            let mut heartbeats = self.heartbeats.lock().unwrap_or_else(|p| p.into_inner());
            if heartbeats.get(&key).is_some_and(recent) {
                return Ok(false);
            }
            if heartbeats.len() >= HEARTBEATS_REMEMBERED_MAX {
                heartbeats.retain(|_, at_ns| recent(at_ns));
            }
            heartbeats.insert(key, now_ns);
        }
        let envelope = self.envelope(Uuid::now_v7().to_string(), 0, Payload::WakeHeartbeat(request.clone()));
        let subject = self.subjects().agent_heartbeat(&request.agent_id);
        match self.append_and_decide(subject, &envelope).await?.1 {
            Verdict::HeartbeatRecorded => Ok(true),
            other => Err(unexpected(other)),
        }
    }

    /// Mutes or unmutes a Slack channel (no thread ts) or thread, or a chat (no thread id) or one
    /// of its threads, for the agent.
    pub async fn change_subscription(
        &self,
        agent_id: &str,
        target: Option<proto::ReplyTarget>,
        mute: bool,
        request_id: &str,
    ) -> Result<u64, CommandError> {
        self.require_agent("agent_id", agent_id)?;
        let target = target.ok_or_else(|| invalid("target", "must name a channel, a chat or a thread"))?;
        Self::target_surface(Some(&target))?;
        let event_id = Self::request_event_id(request_id)?;
        let (slack, chat) = match target.target {
            Some(proto::reply_target::Target::Slack(slack)) => (Some(slack), None),
            Some(proto::reply_target::Target::Chat(chat)) => (None, Some(chat)),
            Some(proto::reply_target::Target::Linear(_)) => {
                return Err(invalid("target", "a Linear session cannot be muted"))
            }
            None => (None, None),
        };
        let request = proto::SubscriptionChangeRequested {
            agent_id: agent_id.to_owned(),
            target: slack,
            mute,
            chat_target: chat,
        };
        let envelope = self.envelope(event_id, 0, Payload::SubscriptionChange(request));
        let (outcome, verdict) = self.append_and_decide(self.subjects().agent(agent_id), &envelope).await?;
        match verdict {
            Verdict::SubscriptionChanged { .. } => Ok(outcome.seq()),
            other => Err(unexpected(other)),
        }
    }

    /// Asks the fold to re-queue running wakes whose last sign of life (log time) is older than
    /// the silence bound, and claimed wakes never started within their lease, by this
    /// instance's clock; the fold re-checks with the log's time. The request id is derived from
    /// the wake's last sign of life and the minute of asking, so instances asking at once append
    /// one request. Returns how many were recovered.
    pub async fn recover_silent_wakes(&self, now_ns: i64) -> Result<usize, CommandError> {
        let candidates: Vec<(String, String, i64, bool)> = {
            let state = self.projection.state();
            state
                .queues
                .iter()
                .filter_map(|(agent, queue)| queue.active.as_ref().map(|active| (agent, active)))
                .filter(|(_, active)| match active.started_seq {
                    Some(_) => {
                        now_ns.saturating_sub(active.last_alive_ns) >= anima_projections::wake::HEARTBEAT_SILENCE_NS
                    }
                    None => active.claim_lease_expired(now_ns),
                })
                .map(|(agent, active)| {
                    (agent.clone(), active.item.id.clone(), active.last_alive_ns, active.started_seq.is_some())
                })
                .collect()
        };
        let mut recovered = 0;
        for (agent, item, last_alive_ns, started) in candidates {
            // Instances asking in the same minute share the id (one request in the log); a request
            // the fold refused (this clock ahead of the log's) is asked again next minute under a
            // new id, not answered by the log's dedupe with the old refusal for its whole window.
            let minute = now_ns.div_euclid(60 * 1_000_000_000);
            let key = format!("recover\0{agent}\0{item}\0{last_alive_ns}\0{started}\0{minute}");
            let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, key.as_bytes()).to_string();
            let request = proto::WakeRecoveryRequested { agent_id: agent.clone(), item_id: item.clone() };
            let envelope = self.envelope(event_id, 0, Payload::WakeRecovery(request));
            match self.append_and_decide(self.subjects().agent(&agent), &envelope).await {
                Ok((_, Verdict::Recovered { started: true, .. })) => {
                    tracing::warn!(agent = %agent, item = %item, "re-queued a running wake whose heartbeat went silent");
                    recovered += 1;
                }
                Ok((_, Verdict::Recovered { started: false, .. })) => {
                    tracing::warn!(agent = %agent, item = %item, "re-queued a claimed wake never started within its lease");
                    recovered += 1;
                }
                Ok(_) | Err(CommandError::Refused(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(recovered)
    }
}

/// Runs [`Engine::recover_silent_wakes`] every `interval` until `shutdown`.
pub async fn run_recovery_loop(
    engine: Engine,
    clock: Arc<dyn crate::clock::Clock>,
    interval: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    crate::clock::every(interval, &shutdown, || async {
        if let Err(e) = engine.recover_silent_wakes(clock.now_ns()).await {
            tracing::warn!(error = %e, "recovery loop");
        }
    })
    .await;
}

/// The agent a request is made for, when the payload names one.
fn request_agent(payload: &Payload) -> Option<&str> {
    Some(match payload {
        Payload::Send(p) => &p.agent_id,
        Payload::SendConfirmed(p) => &p.agent_id,
        Payload::WakeClaim(p) => &p.agent_id,
        Payload::WakeStart(p) => &p.agent_id,
        Payload::WakeFinish(p) => &p.agent_id,
        Payload::WakeHeartbeat(p) => &p.agent_id,
        Payload::WakeRecovery(p) => &p.agent_id,
        Payload::SubscriptionChange(p) => &p.agent_id,
        Payload::LinearResponse(p) => &p.agent_id,
        Payload::LinearResponseOutcome(p) => &p.agent_id,
        Payload::MemoryPass(p) => &p.agent_id,
        Payload::SlackMessage(p) => &p.receiving_agent_id,
        Payload::ChatMessage(p) => &p.receiving_agent_id,
        Payload::LinearSession(p) => &p.receiving_agent_id,
        Payload::SlackThreadStop(p) => &p.receiving_agent_id,
        Payload::AgentRegistered(p) => &p.agent_id,
        Payload::MemoryConfig(_) | Payload::DoNotContact(_) => return None,
    })
}

/// The answer to a request whose event is at `seq`, from the fold's halt (if it stopped at or
/// before `seq`) and the verdict it kept for `seq`.
fn answer(seq: u64, halt: Option<&Halt>, verdict: Option<&Verdict>) -> Result<Verdict, CommandError> {
    if let Some(halt) = halt {
        return Err(CommandError::FailedPrecondition(format!(
            "this instance stopped deciding at seq {}: {}",
            halt.seq, halt.reason
        )));
    }
    match verdict {
        Some(Verdict::Refused(refusal)) => Err(CommandError::Refused(refusal.clone())),
        Some(verdict) => Ok(verdict.clone()),
        None => Err(CommandError::FailedPrecondition(format!(
            "no verdict is kept for seq {seq} (too old, or not a request); send a new request"
        ))),
    }
}

pub(crate) fn unexpected(verdict: Verdict) -> CommandError {
    CommandError::FailedPrecondition(format!("the fold recorded an unexpected verdict: {verdict:?}"))
}

impl CommandError {
    /// The refusal kind, when the fold refused.
    pub fn refusal_kind(&self) -> Option<RefusalKind> {
        match self {
            CommandError::Refused(r) => Some(r.kind),
            _ => None,
        }
    }
}
