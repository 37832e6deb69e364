//! The tonic services of `replay.proto`: `Replay` (incident debugging: the stored log, state as
//! of a point, why a decision was made) and `Analytics` (content-free counts and a tap of
//! redacted events), over [`anima_engine::replay`].
//!
//! Every answer is rebuilt from the log by a [`Replayer`]; the live projection is only read, to
//! say whether its recorded verdict agrees (`Explain`) and to attach live outcomes (`Tap`).
//! The request → query and result → message conversions are free functions, so the replay tool
//! reading a data dir directly prints exactly what it prints through this API.
//!
//! Access: the auth layer lets `replay` and `admin` tokens call `Replay`, and `analytics`,
//! `replay` and `admin` tokens call `Analytics` (see [`crate::auth::allowed`]).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;

use anima_engine::checkpoint::CheckpointStore;
use anima_engine::replay::{
    self, off_the_workers, CursorFacts, EventFilter, Explanation, LogPoint, LogRange, ReadQuery, Rebuilt, ReplayConfig,
    ReplayError, ReplayedEvent, Replayer,
};
use anima_engine::Engine;
use anima_projections::journal::RowMeta;
use anima_projections::proto as events;
use anima_projections::redact::{AnalyticsCounts, Figures, RedactedEvent, RedactedOutcome, RedactedValue, TimeBucket};
use anima_projections::state::FOLD_VERSION;
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::Verdict;
use anima_projections::wake::{PlanEntry, WakeItem};
use futures::{Stream, StreamExt};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::api;

/// Maps a replay error to a gRPC status. The one place where this happens for replay.
pub fn replay_status(error: ReplayError) -> Status {
    crate::services::clipped(replay_status_unclipped(error))
}

fn replay_status_unclipped(error: ReplayError) -> Status {
    match error {
        ReplayError::InvalidArgument { field, reason } => Status::invalid_argument(format!("{field}: {reason}")),
        ReplayError::NotFound(message) => Status::not_found(message),
        ReplayError::Log(anima_engine::log::LogError::Unavailable(message)) => Status::unavailable(message),
        ReplayError::Log(anima_engine::log::LogError::Invalid(message)) => Status::invalid_argument(message),
        ReplayError::Log(e) => Status::failed_precondition(e.to_string()),
        e @ (ReplayError::Locked { .. } | ReplayError::Source(_)) => Status::failed_precondition(e.to_string()),
    }
}

/// Longest list of event types a request may name.
const EVENT_TYPES_MAX: usize = 64;

fn point(point: Option<api::ReplayPoint>, field: &'static str) -> Result<Option<LogPoint>, Status> {
    match point.and_then(|p| p.point) {
        None => Ok(None),
        Some(api::replay_point::Point::Seq(seq)) => Ok(Some(LogPoint::Seq(seq))),
        Some(api::replay_point::Point::LogTimeNs(t)) if t < 0 => {
            Err(Status::invalid_argument(format!("{field}.log_time_ns: must not be negative")))
        }
        Some(api::replay_point::Point::LogTimeNs(t)) => Ok(Some(LogPoint::TimeNs(t))),
    }
}

pub fn range(range: Option<api::ReplayRange>) -> Result<LogRange, Status> {
    let range = range.unwrap_or_default();
    Ok(LogRange { from: point(range.from, "range.from")?, to: point(range.to, "range.to")? })
}

fn event_types(types: Vec<String>, field: &str) -> Result<BTreeSet<String>, Status> {
    if types.len() > EVENT_TYPES_MAX {
        return Err(Status::invalid_argument(format!("{field}: at most {EVENT_TYPES_MAX} event types")));
    }
    Ok(types.into_iter().filter(|t| !t.is_empty()).collect())
}

fn surface(key: &str, field: &str) -> Result<Option<SurfaceId>, Status> {
    if key.is_empty() {
        return Ok(None);
    }
    SurfaceId::parse(key).map(Some).ok_or_else(|| {
        Status::invalid_argument(format!(
            "{field}: {} is not a surface key (slack:T:C or slack:T:C:thread:TS)",
            anima_engine::validate::echo(key)
        ))
    })
}

pub fn filter(filter: Option<api::ReplayFilter>) -> Result<EventFilter, Status> {
    let filter = filter.unwrap_or_default();
    Ok(EventFilter {
        agent: (!filter.agent_id.is_empty()).then_some(filter.agent_id),
        surface: surface(&filter.surface, "filter.surface")?,
        event_types: event_types(filter.event_types, "filter.event_types")?,
    })
}

pub fn read_query(request: api::ReplayReadRequest) -> Result<ReadQuery, Status> {
    Ok(ReadQuery {
        range: range(request.range)?,
        filter: filter(request.filter)?,
        with_verdicts: request.with_outcomes,
        limit: (request.limit > 0).then_some(request.limit),
    })
}

pub fn outcome(outcome: &RedactedOutcome) -> api::AnalyticsOutcome {
    api::AnalyticsOutcome {
        kind: outcome.kind.clone(),
        wake_reason: outcome.wake_reason.clone().unwrap_or_default(),
        refusal: outcome.refusal.clone().unwrap_or_default(),
        settled_without_turn: outcome.settled_without_turn,
        new_messages: outcome.new_messages,
        shown: outcome.shown,
        omitted: outcome.omitted,
        duplicate_message: outcome.duplicate_message,
        ordinal: outcome.ordinal,
        note_shown: outcome.note_shown,
    }
}

pub fn replay_event(event: ReplayedEvent) -> api::ReplayReadResponse {
    let decoded = events::Envelope::decode(event.record.payload.as_ref()).ok();
    api::ReplayReadResponse {
        seq: event.record.seq,
        subject: event.record.subject.to_string(),
        log_time_ns: event.record.timestamp_ns,
        event_type: event.event_type,
        stored: event.record.payload.to_vec(),
        event: decoded,
        outcome: event.verdict.as_ref().map(|v| outcome(&RedactedOutcome::of(v))),
        verdict: event.verdict.as_ref().map(verdict_json).unwrap_or_default(),
    }
}

pub fn analytics_event(event: RedactedEvent) -> api::AnalyticsTapResponse {
    use api::analytics_field::Value as Field;
    api::AnalyticsTapResponse {
        seq: event.seq,
        subject: event.subject,
        log_time_ns: event.log_time_ns,
        event_type: event.event_type,
        event_id: event.event_id,
        source: event.source,
        occurred_at_ms: event.occurred_at_ms,
        min_reader_version: event.min_reader_version,
        event_bytes: event.event_bytes,
        content_bytes: event.content_bytes,
        fields: event
            .fields
            .into_iter()
            .map(|field| api::AnalyticsField {
                path: field.path,
                value: Some(match field.value {
                    RedactedValue::Flag(b) => Field::Flag(b),
                    RedactedValue::Int(n) => Field::Int(n),
                    RedactedValue::Uint(n) => Field::Uint(n),
                    RedactedValue::Number(n) => Field::Number(n),
                    RedactedValue::Enum(name) => Field::EnumName(name),
                    RedactedValue::Id(id) => Field::Id(id),
                    RedactedValue::ContentBytes(n) => Field::ContentBytes(n),
                    RedactedValue::Bytes(n) => Field::Bytes(n),
                    RedactedValue::Count(n) => Field::Count(n),
                }),
            })
            .collect(),
        fields_truncated: event.fields_truncated,
        outcome: event.outcome.as_ref().map(outcome),
    }
}

fn reason_counts(counts: &std::collections::BTreeMap<String, u64>) -> Vec<api::AnalyticsReasonCount> {
    counts.iter().map(|(reason, count)| api::AnalyticsReasonCount { reason: reason.clone(), count: *count }).collect()
}

fn figures(figures: &Figures) -> api::AnalyticsFigures {
    api::AnalyticsFigures {
        events: figures.events,
        event_bytes: figures.event_bytes,
        sends_allowed: figures.sends_allowed,
        sends_held: figures.sends_held,
        send_hold_rate: figures.send_hold_rate(),
        wakes_by_reason: reason_counts(&figures.wakes_by_reason),
        settled_without_turn: figures.settled_without_turn,
        claims: figures.claims,
        starts: figures.starts,
        finishes_by_outcome: reason_counts(&figures.finishes_by_outcome),
        refusals_by_kind: reason_counts(&figures.refusals_by_kind),
        dm_replies_threaded: figures.dm_replies_threaded,
        dm_replies_top_level: figures.dm_replies_top_level,
        notes_shown: figures.notes_shown,
        memory_passes_queued: figures.memory_passes_queued,
        memory_outcomes: reason_counts(&figures.memory_outcomes),
        memory_delay_seconds_sum: figures.memory_delay_seconds_sum,
        memory_delay_count: figures.memory_delay_count,
        wakes_not_queued_queue_full: figures.wakes_not_queued_queue_full,
        failure_notices_owed: figures.failure_notices_owed,
        failure_notices_settled: figures.failure_notices_settled,
        sends_not_contacted: figures.sends_not_contacted,
    }
}

fn bucket(bucket: i32) -> Result<TimeBucket, Status> {
    match api::AnalyticsBucket::try_from(bucket) {
        Ok(api::AnalyticsBucket::Minute) => Ok(TimeBucket::Minute),
        Ok(api::AnalyticsBucket::Hour | api::AnalyticsBucket::Unspecified) => Ok(TimeBucket::Hour),
        Ok(api::AnalyticsBucket::Day) => Ok(TimeBucket::Day),
        Err(_) => Err(Status::invalid_argument(format!("bucket: {bucket} is not an AnalyticsBucket"))),
    }
}

fn bucket_message(bucket: TimeBucket) -> api::AnalyticsBucket {
    match bucket {
        TimeBucket::Minute => api::AnalyticsBucket::Minute,
        TimeBucket::Hour => api::AnalyticsBucket::Hour,
        TimeBucket::Day => api::AnalyticsBucket::Day,
    }
}

pub fn counts_response(counts: AnalyticsCounts, from_seq: u64, to_seq: u64) -> api::AnalyticsCountsResponse {
    api::AnalyticsCountsResponse {
        from_seq,
        to_seq,
        bucket: bucket_message(counts.bucket) as i32,
        buckets: counts
            .buckets
            .iter()
            .map(|(start, bucket)| api::AnalyticsBucketCounts {
                start_ns: *start,
                types: bucket
                    .types
                    .iter()
                    .map(|(event_type, c)| api::AnalyticsTypeCounts {
                        event_type: event_type.clone(),
                        events: c.events,
                        event_bytes: c.event_bytes,
                        content_bytes: c.content_bytes,
                    })
                    .collect(),
                figures: Some(figures(&bucket.figures)),
            })
            .collect(),
        total: Some(figures(&counts.total)),
        buckets_truncated: counts.buckets_truncated,
    }
}

fn row(row: &RowMeta, reader: Option<&str>) -> api::ReplayRow {
    api::ReplayRow {
        ordinal: row.ordinal,
        seq: row.seq,
        log_time_ns: row.at_ns,
        ts: row.ts.to_string(),
        user_id: row.user_id.to_string(),
        bot_id: row.bot_id.to_string(),
        owner: row.owner.as_deref().unwrap_or_default().to_owned(),
        foreign: reader.is_some_and(|agent| !row.is_own(agent)),
        body_bytes: row.body_bytes,
    }
}

fn wake_item(item: &WakeItem) -> api::ReplayWakeItem {
    api::ReplayWakeItem {
        item_id: item.id.clone(),
        reason: item.reason.as_str().to_owned(),
        trigger_surface: item.trigger_surface.to_string(),
        trigger_ordinal: item.trigger.ordinal,
        trigger_seq: item.trigger.seq,
        reply_to: item.reply_to.to_string(),
        queued_seq: item.queued_seq,
        queued_log_time_ns: item.queued_at_ns,
        resume_after_restart: item.resume_after_restart,
    }
}

fn plan_surface(entry: &PlanEntry) -> events::PlanSurface {
    entry.to_plan_surface()
}

/// The state view of `StateAt`.
pub fn state_at_response(
    rebuilt: &Rebuilt,
    agent: Option<&str>,
    surface: Option<&SurfaceId>,
) -> api::ReplayStateAtResponse {
    let state = &rebuilt.state;
    let tail_of = |surface: &SurfaceId| state.journal(surface).map_or(0, |j| j.tail);
    let agent = agent.map(|agent| {
        let record = state.agents.get(agent);
        let queue = state.queue(agent);
        api::ReplayAgentState {
            agent_id: agent.to_owned(),
            registered: record.is_some(),
            slack_bot_user_id: record.map(|r| r.slack_bot_user_id.clone()).unwrap_or_default(),
            slack_bot_id: record.map(|r| r.slack_bot_id.clone()).unwrap_or_default(),
            registered_seq: record.map_or(0, |r| r.registered_seq),
            cursors: state
                .cursor_entries()
                .into_iter()
                .filter(|((owner, _), _)| owner == agent)
                .map(|((owner, surface), cursor)| api::ReplayCursor {
                    agent_id: owner,
                    surface: surface.to_string(),
                    cursor,
                    tail: tail_of(&surface),
                })
                .collect(),
            queued: state.queued_items(agent).iter().map(wake_item).collect(),
            active: queue.and_then(|q| q.active.as_ref()).map(|active| api::ReplayActiveWake {
                item: Some(wake_item(&active.item)),
                worker_id: active.worker.clone(),
                claimed_seq: active.claimed_seq,
                started_seq: active.started_seq.unwrap_or_default(),
                plan: active.plan.iter().map(plan_surface).collect(),
            }),
            settled_remembered: queue.map_or(0, |q| u64::from(q.settled_remembered)),
            subscriptions: state
                .subscriptions_of(agent)
                .into_iter()
                .map(|(surface, subscription)| format!("{surface}: {}", json(&subscription)))
                .collect(),
            memory_gate: describe_memory_gate(&state.memory_gate(agent)),
        }
    });
    let surface = surface.map(|surface| {
        let journal = state.journal(surface);
        api::ReplaySurfaceState {
            surface: surface.to_string(),
            tail: tail_of(surface),
            trailing_owner: journal.as_ref().and_then(|j| j.trailing_owner.as_deref()).unwrap_or_default().to_owned(),
            trailing_run_start: journal.as_ref().map_or(0, |j| j.trailing_run_start),
            cursors: state
                .cursor_entries()
                .into_iter()
                .filter(|((_, on), _)| on == surface)
                .map(|((agent, on), cursor)| api::ReplayCursor {
                    agent_id: agent,
                    surface: on.to_string(),
                    cursor,
                    tail: tail_of(&on),
                })
                .collect(),
            recent_rows: state.recent_rows(surface).iter().map(|r| row(r, None)).collect(),
        }
    });
    api::ReplayStateAtResponse {
        as_of_seq: rebuilt.seq,
        as_of_log_time_ns: rebuilt.log_time_ns,
        fold_version: FOLD_VERSION,
        halted: state.meta.halted.as_ref().map(|h| format!("at seq {}: {}", h.seq, h.reason)).unwrap_or_default(),
        state_sha256: rebuilt.state_sha256(),
        agent,
        surface,
        agents: state.agents.len() as u64,
        surfaces: state.journals_len() as u64,
        cursors: state.cursors_len() as u64,
        verdicts_kept: state.verdicts.len() as u64,
    }
}

/// How a live verdict compares with the replayed one.
pub fn live_verdict(replayed: Option<&Verdict>, live: Option<&Verdict>, live_applied: bool) -> String {
    match (live_applied, replayed, live) {
        (false, _, _) => "not applied yet".to_owned(),
        (true, _, None) => "not kept".to_owned(),
        (true, Some(replayed), Some(live)) if replayed == live => "same".to_owned(),
        (true, _, Some(_)) => "differs".to_owned(),
    }
}

pub fn explain_response(explanation: Explanation) -> api::ReplayExplainResponse {
    let Explanation { record, event_type, verdict, facts, cursor, halted: _ } = explanation;
    let mut response = api::ReplayExplainResponse {
        seq: record.seq,
        subject: record.subject.to_string(),
        log_time_ns: record.timestamp_ns,
        event_type,
        outcome: verdict.as_ref().map(|v| outcome(&RedactedOutcome::of(v))),
        verdict: verdict.as_ref().map(verdict_json).unwrap_or_default(),
        facts,
        ..Default::default()
    };
    if let Some(CursorFacts { agent, surface, cursor, tail, rows_after_cursor, foreign_rows_after_cursor }) = cursor {
        response.rows_after_cursor = rows_after_cursor.iter().map(|r| row(r, Some(&agent))).collect();
        response.agent_id = agent;
        response.surface = surface.to_string();
        response.cursor_present = cursor.is_some();
        response.cursor = cursor.unwrap_or_default();
        response.tail = tail;
        response.foreign_rows_after_cursor = foreign_rows_after_cursor;
    }
    response
}

/// `StateAt` against a replayer (the service and the replay tool share it).
pub async fn state_at(
    replayer: &Replayer,
    request: api::ReplayStateAtRequest,
) -> Result<api::ReplayStateAtResponse, Status> {
    let at = point(request.at, "at")?;
    let surface = surface(&request.surface, "surface")?;
    let agent = (!request.agent_id.is_empty()).then_some(request.agent_id);
    let rebuilt = replayer.rebuild(at).await.map_err(replay_status)?;
    // The view hashes the whole state (and may be the last holder of it, freeing it).
    off_the_workers(move || state_at_response(&rebuilt, agent.as_deref(), surface.as_ref()))
        .await
        .map_err(replay_status)
}

/// A recorded verdict as JSON: the fold's own structure, readable by scripts and people, never
/// Rust's debug text.
fn verdict_json(verdict: &anima_projections::verdict::Verdict) -> String {
    json(verdict)
}

/// A projection value as compact JSON (they all derive `Serialize`; encoding cannot fail for
/// them, and an empty string says so if it ever did).
fn json(value: &impl serde::Serialize) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// `Counts` against a replayer, answered from the maintained counters of `projection` when they
/// cover the range exactly (O(buckets)), else by refolding it.
pub async fn counts(
    replayer: &Replayer,
    projection: Option<&anima_engine::Projection>,
    request: api::AnalyticsCountsRequest,
) -> Result<api::AnalyticsCountsResponse, Status> {
    let range = range(request.range)?;
    let bucket = bucket(request.bucket)?;
    let (from, to, counts) =
        anima_engine::analytics::answer_counts(replayer, projection, range, bucket).await.map_err(replay_status)?;
    Ok(counts_response(counts, from, to))
}

/// A server stream of `T`.
pub type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The `Replay` and `Analytics` services of one engine instance.
#[derive(Clone)]
pub struct ReplayServices {
    engine: Engine,
    replayer: Arc<Replayer>,
    /// Ends `Read` and `Tap` streams when the server shuts down.
    shutdown: CancellationToken,
}

impl ReplayServices {
    /// `checkpoints`: the runner's checkpoint store, where a `StateAt` or `Explain` with no kept
    /// snapshot close enough before its point starts (see `Replayer::with_checkpoint`).
    pub fn new(engine: Engine, checkpoints: CheckpointStore, shutdown: CancellationToken) -> Self {
        let replayer =
            Arc::new(Replayer::new(engine.log().clone(), ReplayConfig::default()).with_checkpoint(checkpoints));
        ReplayServices { engine, replayer, shutdown }
    }
}

#[tonic::async_trait]
impl api::replay_server::Replay for ReplayServices {
    type ReadStream = ResponseStream<api::ReplayReadResponse>;

    async fn read(&self, request: Request<api::ReplayReadRequest>) -> Result<Response<Self::ReadStream>, Status> {
        let query = read_query(request.into_inner())?;
        let events = self.replayer.read(query).await.map_err(replay_status)?;
        let stream = events
            .map(|event| event.map(replay_event).map_err(replay_status))
            .take_until(self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }

    async fn state_at(
        &self,
        request: Request<api::ReplayStateAtRequest>,
    ) -> Result<Response<api::ReplayStateAtResponse>, Status> {
        Ok(Response::new(state_at(&self.replayer, request.into_inner()).await?))
    }

    async fn explain(
        &self,
        request: Request<api::ReplayExplainRequest>,
    ) -> Result<Response<api::ReplayExplainResponse>, Status> {
        let seq = request.into_inner().seq;
        let explanation = self.replayer.explain(seq).await.map_err(replay_status)?;
        let projection = self.engine.projection();
        let live = {
            let state = projection.state();
            live_verdict(explanation.verdict.as_ref(), state.verdict(seq), state.meta.applied_seq >= seq)
        };
        let mut response = explain_response(explanation);
        response.live_verdict = live;
        Ok(Response::new(response))
    }
}

#[tonic::async_trait]
impl api::analytics_server::Analytics for ReplayServices {
    type TapStream = ResponseStream<api::AnalyticsTapResponse>;

    async fn counts(
        &self,
        request: Request<api::AnalyticsCountsRequest>,
    ) -> Result<Response<api::AnalyticsCountsResponse>, Status> {
        Ok(Response::new(counts(&self.replayer, Some(self.engine.projection()), request.into_inner()).await?))
    }

    async fn tap(&self, request: Request<api::AnalyticsTapRequest>) -> Result<Response<Self::TapStream>, Status> {
        let request = request.into_inner();
        let types = event_types(request.event_types, "event_types")?;
        let events =
            replay::tap(self.engine.log().clone(), Some(self.engine.projection().clone()), request.from_seq, types)
                .await
                .map_err(replay_status)?;
        let stream = events
            .map(|event| event.map(analytics_event).map_err(replay_status))
            .take_until(self.shutdown.clone().cancelled_owned());
        Ok(Response::new(Box::pin(stream)))
    }
}

/// One line for an agent's memory-pass gate.
fn describe_memory_gate(gate: &anima_projections::memory::MemoryGate) -> String {
    let last = gate.last_outcome.as_ref().map_or_else(
        || "none".to_owned(),
        |o| format!("{} {} at seq {}", o.pass_id, o.outcome.as_str(), o.finished_seq),
    );
    format!(
        "newest history at seq {}, newest outcome at seq {} ({}); newest window-day queued: {}; last outcome: {last}",
        gate.newest_history_seq,
        gate.newest_outcome_seq,
        if gate.eligible() { "eligible" } else { "not eligible" },
        if gate.last_window_day.is_empty() { "none" } else { gate.last_window_day.as_str() },
    )
}

#[cfg(test)]
mod tests {
    use anima_projections::redact::Redactor;

    use super::*;

    /// Markers in every content field of an event never reach the analytics message's bytes.
    #[test]
    fn analytics_messages_carry_no_content() {
        let envelope = events::Envelope {
            event_id: "e-1".into(),
            occurred_at_ms: 5,
            min_reader_version: 1,
            source: "test".into(),
            payload: Some(events::envelope::Payload::SlackMessage(events::SlackMessageObserved {
                receiving_agent_id: "ada".into(),
                kind: events::SlackDeliveryKind::Message as i32,
                team_id: "T1".into(),
                channel_id: "D1".into(),
                ts: "1700000000.000100".into(),
                user_id: "U1".into(),
                text: "MARKER-TEXT-7f3a".into(),
                user_name: "MARKER-NAME-7f3a".into(),
                files: vec![events::SlackFile { name: "MARKER-FILE-7f3a".into(), size_bytes: 9 }],
                ..Default::default()
            })),
        };
        let mut redacted =
            Redactor::schema().redact(3, 1_000, "anima.v1.surface.slack.T1.D1", &envelope.encode_to_vec());
        redacted.outcome = Some(RedactedOutcome { kind: "journaled".into(), ..Default::default() });
        let message = analytics_event(redacted).encode_to_vec();
        let haystack = String::from_utf8_lossy(&message);
        assert!(!haystack.contains("MARKER"), "content leaked into an AnalyticsTapResponse");
        assert!(haystack.contains("ada") && haystack.contains("D1"), "ids are kept");
    }

    #[test]
    fn live_verdicts_are_compared() {
        let verdict = Verdict::AgentRegistered;
        assert_eq!(live_verdict(Some(&verdict), Some(&verdict), true), "same");
        assert_eq!(live_verdict(Some(&verdict), None, true), "not kept");
        assert_eq!(live_verdict(Some(&verdict), None, false), "not applied yet");
    }
}
