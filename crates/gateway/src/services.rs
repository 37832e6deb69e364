//! The tonic services. Each handler authorizes the agent its request names, converts the request
//! into an engine command, and converts the fold's verdict back. Engine errors become gRPC status
//! codes in one place ([`status`]).

use std::pin::Pin;

use anima_engine::command::{ChatObservation, IngestOutcome, LinearIngestOutcome, LinearObservation, SlackObservation};
use anima_engine::{CommandError, Engine};
use anima_projections::proto as events;
use anima_projections::verdict::{RefusalKind, SendVerdict};
use anima_projections::wake::PlanEntry;
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use crate::api;
use crate::auth::Principal;

/// Longest status message sent, in bytes. Messages quote client values clipped
/// (`anima_engine::validate::echo`); this bound is the last guard, because a message over gRPC's
/// metadata limit reaches the client as RESOURCE_EXHAUSTED "metadata size exceeds hard limit"
/// instead of the refusal.
pub const STATUS_MESSAGE_BYTES_MAX: usize = 2_048;

/// Maps an engine error to a gRPC status. The one place where this happens.
pub fn status(error: CommandError) -> Status {
    clipped(status_unclipped(error))
}

/// `status` with its message cut to [`STATUS_MESSAGE_BYTES_MAX`] bytes (and `…`).
pub fn clipped(status: Status) -> Status {
    if status.message().len() <= STATUS_MESSAGE_BYTES_MAX {
        return status;
    }
    let mut end = STATUS_MESSAGE_BYTES_MAX;
    while !status.message().is_char_boundary(end) {
        end -= 1;
    }
    Status::new(status.code(), format!("{}…", &status.message()[..end]))
}

fn status_unclipped(error: CommandError) -> Status {
    match error {
        CommandError::InvalidArgument { field, reason } => Status::invalid_argument(format!("{field}: {reason}")),
        CommandError::TooLarge { field, reason } => Status::resource_exhausted(format!("{field}: too large: {reason}")),
        CommandError::Refused(refusal) => match refusal.kind {
            RefusalKind::InvalidArgument => Status::invalid_argument(refusal.message),
            RefusalKind::Aborted => Status::aborted(refusal.message),
            RefusalKind::FailedPrecondition => Status::failed_precondition(refusal.message),
        },
        CommandError::Unavailable(message) => Status::unavailable(message),
        CommandError::FailedPrecondition(message) => Status::failed_precondition(message),
    }
}

#[derive(Clone)]
pub struct Services {
    pub engine: Engine,
    /// Cancelled on shutdown: long-lived streams end on it.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// Wakes and sends are counted here (`crate::metrics`); refusals by its layer.
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
}

fn outcome_message(outcome: IngestOutcome) -> api::AppendOutcome {
    api::AppendOutcome {
        agent_id: outcome.agent,
        seq: outcome.seq,
        duplicate_event: outcome.duplicate_event,
        ordinal: outcome.journal.ordinal,
        duplicate_message: outcome.journal.duplicate_message,
        surface: outcome.journal.surface.map(|s| s.to_string()).unwrap_or_default(),
        wake_reason: outcome.journal.wake.map(|w| w.as_str().to_owned()).unwrap_or_default(),
        ..Default::default()
    }
}

fn linear_outcome_message(outcome: LinearIngestOutcome) -> api::AppendOutcome {
    let verdict = outcome.verdict;
    api::AppendOutcome {
        agent_id: verdict.agent,
        seq: outcome.seq,
        duplicate_event: outcome.duplicate_event,
        surface: anima_projections::surface::SurfaceId::Linear { session: verdict.session.into() }.to_string(),
        wake_reason: verdict.wake.map(|w| w.as_str().to_owned()).unwrap_or_default(),
        receipt_id: verdict.receipt.unwrap_or_default(),
        duplicate_receipt: verdict.duplicate_receipt,
        removed_item_ids: verdict.removed,
        ..Default::default()
    }
}

impl Services {
    async fn append_one(
        &self,
        principal: &Principal,
        request: api::AppendRequest,
    ) -> Result<api::AppendResponse, Status> {
        let outcomes = match request.observation {
            Some(api::append_request::Observation::SlackMessage(message)) => {
                let observation = SlackObservation {
                    receiving_agent_ids: message.receiving_agent_ids,
                    message: events::SlackMessageObserved {
                        receiving_agent_id: String::new(),
                        kind: message.kind,
                        team_id: message.team_id,
                        channel_id: message.channel_id,
                        ts: message.ts,
                        thread_ts: message.thread_ts,
                        subtype: message.subtype,
                        user_id: message.user_id,
                        bot_id: message.bot_id,
                        text: message.text,
                        files: message.files,
                        user_name: message.user_name,
                        previews: message.previews,
                    },
                    occurred_at_ms: message.occurred_at_ms,
                };
                self.engine.ingest_slack(observation).await.map_err(status)?.into_iter().map(outcome_message).collect()
            }
            Some(api::append_request::Observation::ChatMessage(message)) => {
                let observation = ChatObservation {
                    receiving_agent_ids: message.receiving_agent_ids,
                    message: events::ChatMessageObserved {
                        receiving_agent_id: String::new(),
                        tenant_id: message.tenant_id,
                        chat_id: message.chat_id,
                        chat_kind: message.chat_kind,
                        message_id: message.message_id,
                        thread_id: message.thread_id,
                        sender_id: message.sender_id,
                        sender_is_bot: message.sender_is_bot,
                        sender_name: message.sender_name,
                        text: message.text,
                        files: message.files,
                        mentioned_user_ids: message.mentioned_user_ids,
                    },
                    occurred_at_ms: message.occurred_at_ms,
                };
                self.engine.ingest_chat(observation).await.map_err(status)?.into_iter().map(outcome_message).collect()
            }
            Some(api::append_request::Observation::LinearSession(session)) => {
                let observation = LinearObservation {
                    event: events::LinearSessionEvent {
                        receiving_agent_id: session.receiving_agent_id,
                        installation_id: session.installation_id,
                        kind: session.kind,
                        session_id: session.session_id,
                        agent_activity_id: session.agent_activity_id,
                        issue_identifier: session.issue_identifier,
                        issue_url: session.issue_url,
                        issue_title: session.issue_title,
                        prompt_text: session.prompt_text,
                    },
                    occurred_at_ms: session.occurred_at_ms,
                };
                vec![linear_outcome_message(self.engine.ingest_linear(observation).await.map_err(status)?)]
            }
            Some(api::append_request::Observation::SlackThreadStop(stop)) => {
                let observed = events::SlackThreadStopObserved {
                    receiving_agent_id: stop.receiving_agent_id,
                    team_id: stop.team_id,
                    channel_id: stop.channel_id,
                    thread_ts: stop.thread_ts,
                };
                let outcome = self.engine.stop_slack_thread(observed, stop.occurred_at_ms).await.map_err(status)?;
                vec![api::AppendOutcome {
                    agent_id: outcome.verdict.agent,
                    seq: outcome.seq,
                    duplicate_event: outcome.duplicate_event,
                    surface: outcome.verdict.surface.to_string(),
                    removed_item_ids: outcome.verdict.removed,
                    ..Default::default()
                }]
            }
            Some(api::append_request::Observation::Agent(registration)) => {
                principal.require(crate::auth::Action::RegisterAgent)?;
                let agent_id = registration.agent_id.clone();
                let seq = self.engine.register_agent(registration).await.map_err(status)?;
                vec![api::AppendOutcome { agent_id, seq, ..Default::default() }]
            }
            None => return Err(Status::invalid_argument("observation: must be set")),
        };
        Ok(api::AppendResponse { correlation_id: request.correlation_id, outcomes })
    }
}

/// Requests an AppendStream keeps in flight at once; responses still come in request order.
const APPEND_STREAM_IN_FLIGHT_MAX: usize = 256;

type ResponseStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl api::ingest_server::Ingest for Services {
    async fn append(&self, request: Request<api::AppendRequest>) -> Result<Response<api::AppendResponse>, Status> {
        let principal = Principal::of(&request)?;
        Ok(Response::new(self.append_one(&principal, request.into_inner()).await?))
    }

    type AppendStreamStream = ResponseStream<api::AppendStreamResponse>;

    async fn append_stream(
        &self,
        request: Request<Streaming<api::AppendStreamRequest>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        let principal = Principal::of(&request)?;
        let services = self.clone();
        let responses = request
            .into_inner()
            .map(move |item| {
                let services = services.clone();
                let principal = principal.clone();
                async move {
                    // A request that does not decode is the client's mistake, as on a unary call.
                    let request = item.map_err(crate::transport_limit::client_facing)?.append.unwrap_or_default();
                    let correlation_id = request.correlation_id.clone();
                    let result = match services.append_one(&principal, request).await {
                        Ok(response) => api::append_stream_response::Result::Appended(response),
                        Err(status) => {
                            services.metrics.refused("/anima.v1.Ingest/AppendStream", status.code());
                            api::append_stream_response::Result::Error(api::ErrorDetail {
                                code: status.code() as i32,
                                message: status.message().to_owned(),
                            })
                        }
                    };
                    Ok(api::AppendStreamResponse { correlation_id, result: Some(result) })
                }
            })
            .buffered(APPEND_STREAM_IN_FLIGHT_MAX);
        Ok(Response::new(Box::pin(responses)))
    }
}

/// Whether the agent has a claimable wake, and how many are queued, as of the fold's state.
fn wake_signal(engine: &Engine, agent: &str) -> api::WatchResponse {
    let state = engine.projection().state();
    let queue = state.queue(agent);
    let queued = queue.map_or(0, |q| q.queued_len());
    let claimable = queue.is_some_and(|q| q.active.is_none() && !q.nothing_queued());
    api::WatchResponse {
        agent_id: agent.to_owned(),
        queued: u32::try_from(queued).unwrap_or(u32::MAX),
        claimable,
        as_of_seq: state.meta.applied_seq,
        notices_owed: u32::try_from(state.notices_owed_of(agent).count()).unwrap_or(u32::MAX),
    }
}

/// The failure notices the agent owes now, oldest first.
fn notices_owed(engine: &Engine, agent: &str) -> Vec<api::OwedNotice> {
    let state = engine.projection().state();
    state
        .notices_owed_of(agent)
        .map(|notice| api::OwedNotice {
            item_id: notice.item_id.clone(),
            reason: notice.reason.as_str().to_owned(),
            reply_to: Some(notice.reply_to.to_target()),
            wake_reason: notice.wake_reason.as_str().to_owned(),
            owed_at_seq: notice.owed_seq,
        })
        .collect()
}

#[tonic::async_trait]
impl api::wakes_server::Wakes for Services {
    type WatchStream = ResponseStream<api::WatchResponse>;

    async fn watch(&self, request: Request<api::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let principal = Principal::of(&request)?;
        let agent = request.into_inner().agent_id;
        principal.require_agent(&agent)?;
        anima_engine::validate::id("agent_id", &agent).map_err(status)?;
        if !self.engine.projection().is_registered(&agent) {
            return Err(Status::invalid_argument(format!(
                "agent_id: unknown agent {}",
                anima_engine::validate::echo(&agent)
            )));
        }
        let watch = WatchState {
            applied: self.engine.projection().subscribe_applied(),
            engine: self.engine.clone(),
            agent,
            shutdown: self.shutdown.clone(),
            last: None,
        };
        // The first signal at once; then a change of `claimable` or `notices_owed` at once, and a
        // change of `queued` alone at most every WATCH_QUEUED_ONLY_EVERY. The stream is the
        // response itself (no task of its own): when the client goes away, tonic drops it and
        // nothing is left waking on every fold batch.
        let stream = futures::stream::unfold(watch, |mut watch| async move {
            loop {
                let signal = wake_signal(&watch.engine, &watch.agent);
                let key = (signal.queued, signal.claimable, signal.notices_owed);
                let now = tokio::time::Instant::now();
                // Nothing to signal yet: wait for the fold, and for a held-back count, its time.
                let held_until = match watch.last {
                    Some((last, _)) if last == key => None,
                    Some(((_, claimable, notices), sent))
                        if (claimable, notices) == (key.1, key.2) && now < sent + WATCH_QUEUED_ONLY_EVERY =>
                    {
                        Some(sent + WATCH_QUEUED_ONLY_EVERY)
                    }
                    _ => {
                        watch.last = Some((key, now));
                        return Some((Ok(signal), watch));
                    }
                };
                let held = async {
                    match held_until {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = watch.shutdown.cancelled() => return None,
                    changed = watch.applied.changed() => if changed.is_err() { return None },
                    () = held => {}
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn heartbeat(
        &self,
        request: Request<api::HeartbeatRequest>,
    ) -> Result<Response<api::HeartbeatResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let heartbeat = events::WakeHeartbeat {
            agent_id: request.agent_id,
            worker_id: request.worker_id,
            item_id: request.item_id,
        };
        let appended = self.engine.heartbeat(heartbeat).await.map_err(status)?;
        Ok(Response::new(api::HeartbeatResponse { appended }))
    }

    async fn claim(&self, request: Request<api::ClaimRequest>) -> Result<Response<api::ClaimResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let claim = events::WakeClaimRequested {
            agent_id: request.agent_id.clone(),
            worker_id: request.worker_id,
            item_id: request.item_id,
            memory_md_bytes: request.memory_md_bytes,
            // The engine sets the lease from its configuration.
            claim_lease_seconds: 0,
        };
        let outcome = self.engine.claim(claim, &request.request_id).await.map_err(status)?;
        self.metrics.wake_claimed(&outcome);
        let wake = outcome.wake.map(|wake| {
            let claimed = wake.claimed;
            api::Wake {
                agent_id: request.agent_id.clone(),
                item_id: claimed.item.id.clone(),
                reason: claimed.item.reason.as_str().to_owned(),
                plan: claimed.plan.iter().map(PlanEntry::to_plan_surface).collect(),
                text: wake.text,
                // A memory pass answers nobody: no target.
                reply_to: Some(claimed.item.reply_to.to_target()).filter(|t| t.target.is_some()),
                prepared_at_seq: outcome.seq,
            }
        });
        let notices_owed = notices_owed(&self.engine, &request.agent_id);
        Ok(Response::new(api::ClaimResponse { wake, settled_without_turn: outcome.settled_without_turn, notices_owed }))
    }

    async fn start(&self, request: Request<api::StartRequest>) -> Result<Response<api::StartResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let start = events::WakeStartRequested {
            agent_id: request.agent_id,
            worker_id: request.worker_id,
            item_id: request.item_id,
            plan: request.plan,
        };
        let seq = self.engine.start(start, &request.request_id).await.map_err(status)?;
        self.metrics.wake_started();
        Ok(Response::new(api::StartResponse { started_at_seq: seq }))
    }

    async fn finish(&self, request: Request<api::FinishRequest>) -> Result<Response<api::FinishResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let (outcome, restart_drain) = (request.outcome, request.restart_drain);
        let finish = events::WakeFinishRequested {
            agent_id: request.agent_id,
            worker_id: request.worker_id,
            item_id: request.item_id,
            outcome: request.outcome,
            reason: request.reason,
            restart_drain: request.restart_drain,
            memory_digest_before: request.memory_digest_before,
            memory_digest_after: request.memory_digest_after,
        };
        let finished = self.engine.finish(finish, &request.request_id).await.map_err(status)?;
        self.metrics.wake_finished(outcome, restart_drain);
        Ok(Response::new(api::FinishResponse {
            finished_at_seq: finished.seq,
            memory_outcome: finished.memory_outcome.map(|o| o.outcome.as_str().to_owned()).unwrap_or_default(),
        }))
    }
}

#[tonic::async_trait]
impl api::sends_server::Sends for Services {
    async fn send(&self, request: Request<api::SendRequest>) -> Result<Response<api::SendResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let send = events::SendRequested {
            agent_id: request.agent_id,
            target: request.target,
            kind: request.kind,
            draft_bytes: request.draft_bytes,
            mentioned_user_ids: request.mentioned_user_ids,
        };
        let decision = self.engine.send(send, &request.request_id).await.map_err(status)?;
        self.metrics.send_decided(&decision.verdict);
        let verdict = match (decision.verdict, decision.already_posted) {
            (_, Some(posted)) => api::send_response::Verdict::AlreadyPosted(api::SendAlreadyPosted {
                ts: posted.ts,
                confirmed_at_seq: posted.confirmed_seq,
            }),
            (SendVerdict::Allowed { .. }, None) => api::send_response::Verdict::Allowed(api::SendAllowed {}),
            (SendVerdict::Held(held), None) => api::send_response::Verdict::Held(api::SendHeld {
                new_messages: u32::try_from(held.new_messages).unwrap_or(u32::MAX),
                shown: held.shown.len() as u32,
                omitted: u32::try_from(held.omitted).unwrap_or(u32::MAX),
                notice: decision.notice.unwrap_or_default(),
            }),
            (SendVerdict::NotContacted(refused), None) => {
                api::send_response::Verdict::NotContacted(api::SendNotContacted {
                    reason: refused.reason.as_str().to_owned(),
                    user_id: refused.user_id.unwrap_or_default(),
                })
            }
        };
        Ok(Response::new(api::SendResponse { decided_at_seq: decision.seq, verdict: Some(verdict) }))
    }

    async fn confirm(
        &self,
        request: Request<api::SendsConfirmRequest>,
    ) -> Result<Response<api::SendsConfirmResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        // A confirmation is keyed by its post (agent, surface, ts, kind), not by request_id; the
        // id is still checked like on every RPC, so a client's malformed id is reported, not lost.
        anima_engine::validate::request_id(&request.request_id).map_err(status)?;
        // The stored confirmation carries the post's place on its surface in `ts`: Slack's ts, or
        // the chat platform's message id.
        let is_chat =
            matches!(request.target.as_ref().and_then(|t| t.target.as_ref()), Some(api::reply_target::Target::Chat(_)));
        let ts = match (is_chat, request.ts.is_empty(), request.message_id.is_empty()) {
            (true, true, _) => request.message_id,
            (true, false, _) => {
                return Err(Status::invalid_argument("ts: must be empty for a chat target; set message_id"))
            }
            (false, _, true) => request.ts,
            (false, _, false) => {
                return Err(Status::invalid_argument("message_id: only for chat targets; set ts for a Slack target"))
            }
        };
        let confirmation = events::SendConfirmed {
            agent_id: request.agent_id,
            target: request.target,
            kind: request.kind,
            ts,
            text: request.text,
            files: request.files,
            send_event_id: String::new(),
        };
        let outcome = self.engine.confirm(confirmation, &request.send_request_id).await.map_err(status)?;
        Ok(Response::new(api::SendsConfirmResponse {
            seq: outcome.seq,
            duplicate_event: outcome.duplicate_event,
            ordinal: if outcome.journal.duplicate_message { 0 } else { outcome.journal.ordinal },
        }))
    }

    async fn respond(&self, request: Request<api::RespondRequest>) -> Result<Response<api::RespondResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let respond = events::LinearResponseRequested {
            agent_id: request.agent_id,
            session_id: request.session_id,
            kind: request.kind,
            body: request.body,
            input_ids: request.input_ids,
        };
        let decision = self.engine.respond_linear(respond, &request.request_id).await.map_err(status)?;
        Ok(Response::new(api::RespondResponse {
            decided_at_seq: decision.seq,
            activity_id: decision.verdict.activity_id,
            state: decision.verdict.state.as_str().to_owned(),
            repeated: decision.verdict.repeated,
        }))
    }

    async fn confirm_response(
        &self,
        request: Request<api::ConfirmResponseRequest>,
    ) -> Result<Response<api::ConfirmResponseResponse>, Status> {
        let principal = Principal::of(&request)?;
        let request = request.into_inner();
        principal.require_agent(&request.agent_id)?;
        let outcome = events::LinearResponseOutcome {
            agent_id: request.agent_id,
            activity_id: request.activity_id,
            result: request.result,
        };
        let decision = self.engine.confirm_linear_response(outcome, &request.request_id).await.map_err(status)?;
        Ok(Response::new(api::ConfirmResponseResponse {
            seq: decision.seq,
            state: decision.verdict.state.as_str().to_owned(),
        }))
    }
}

/// What one `Wakes.Watch` stream carries from signal to signal.
struct WatchState {
    applied: tokio::sync::watch::Receiver<u64>,
    engine: Engine,
    agent: String,
    shutdown: tokio_util::sync::CancellationToken,
    /// The (queued, claimable, notices owed) last signalled, and when.
    last: Option<((u32, bool, u32), tokio::time::Instant)>,
}

/// How often a `Wakes.Watch` stream signals a change of the queue's length alone. Under load an
/// agent's queue changes with nearly every fold batch: `anima-load`'s default run got about 150
/// signals a second per agent with a signal per change, and 50 with this bound (most of them
/// now `claimable` flipping at each claim and finish). Each was a message for the engine and
/// the client to handle for a count that no decision waits on; whether a claim would get a wake
/// (`claimable`) and `notices_owed` still go at once.
const WATCH_QUEUED_ONLY_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

#[tonic::async_trait]
impl api::subscriptions_server::Subscriptions for Services {
    async fn mute(&self, request: Request<api::MuteRequest>) -> Result<Response<api::MuteResponse>, Status> {
        let principal = Principal::of(&request)?;
        let api::MuteRequest { agent_id, target, request_id, chat_target } = request.into_inner();
        let seq = self
            .change_subscription(&principal, SubscriptionChange { agent_id, target, chat_target, request_id }, true)
            .await?;
        Ok(Response::new(api::MuteResponse { seq }))
    }

    async fn unmute(&self, request: Request<api::UnmuteRequest>) -> Result<Response<api::UnmuteResponse>, Status> {
        let principal = Principal::of(&request)?;
        let api::UnmuteRequest { agent_id, target, request_id, chat_target } = request.into_inner();
        let seq = self
            .change_subscription(&principal, SubscriptionChange { agent_id, target, chat_target, request_id }, false)
            .await?;
        Ok(Response::new(api::UnmuteResponse { seq }))
    }

    async fn list(
        &self,
        request: Request<api::SubscriptionsListRequest>,
    ) -> Result<Response<api::SubscriptionsListResponse>, Status> {
        let principal = Principal::of(&request)?;
        let api::SubscriptionsListRequest { agent_id: agent, page_size, page_token } = request.into_inner();
        principal.require_agent(&agent)?;
        let limit = match page_size {
            0 => SUBSCRIPTIONS_PAGE_DEFAULT,
            n => (n as usize).min(SUBSCRIPTIONS_PAGE_MAX),
        };
        let after = match page_token.as_str() {
            "" => None,
            token => Some(decode_page_token(token).ok_or_else(not_a_page_token)?),
        };
        let ((page, next), as_of_seq) = self.subscriptions_page(&agent, after.as_deref(), limit).await?;
        let subscriptions = page
            .into_iter()
            .filter(|(_, s)| s.member || s.following || s.muted)
            .map(|(surface, s)| {
                let (target, chat_target) = match surface.to_target().target {
                    Some(api::reply_target::Target::Slack(target)) => (Some(target), None),
                    Some(api::reply_target::Target::Chat(target)) => (None, Some(target)),
                    // Sessions have no subscriptions.
                    Some(api::reply_target::Target::Linear(_)) | None => (None, None),
                };
                api::Subscription {
                    surface: surface.to_string(),
                    target,
                    member: s.member,
                    following: s.following,
                    muted: s.muted,
                    wakes_since_post: s.attention.wakes_since_post,
                    chat_target,
                }
            })
            .collect();
        let next_page_token = next.map(hex::encode).unwrap_or_default();
        Ok(Response::new(api::SubscriptionsListResponse { subscriptions, as_of_seq, next_page_token }))
    }
}

impl Services {
    /// A page of `agent`'s subscriptions and the applied seq it is as of. The state's lock is
    /// held to look at memory and again to finish, not while the store is read: a page of a
    /// large history reads a thousand entries and their surface names from the store, and
    /// every request waiting for its verdict waits while the lock is held (under `anima-load`,
    /// a walk of every page of one agent every 10 s gave bursts of Sends slower than 100 ms).
    /// A checkpoint taken meanwhile may have changed what was read: then again, and after
    /// [`PAGE_READS_WITHOUT_LOCK`] tries, with the lock held throughout.
    async fn subscriptions_page(
        &self,
        agent: &str,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<(anima_projections::subscription::SubscriptionsPage, u64), Status> {
        let projection = self.engine.projection();
        for _ in 0..PAGE_READS_WITHOUT_LOCK {
            let (mut read, as_of_seq) = {
                let state = projection.state();
                known_agent(&state, agent)?;
                (
                    state.subscriptions_page_begin(agent, after, limit).map_err(|_| not_a_page_token())?,
                    state.meta.applied_seq,
                )
            };
            let read = tokio::task::spawn_blocking(move || {
                read.read_store();
                read
            })
            .await
            .map_err(|e| Status::internal(format!("reading a page of subscriptions: {e}")))?;
            if let Some(page) = projection.state().subscriptions_page_end(read) {
                return Ok((page, as_of_seq));
            }
        }
        let state = projection.state();
        known_agent(&state, agent)?;
        let page = state.subscriptions_page(agent, after, limit).map_err(|_| not_a_page_token())?;
        Ok((page, state.meta.applied_seq))
    }
}

/// Tries at reading a page of subscriptions without the state's lock before one with it. A
/// checkpoint is taken every 2,000 events or 5 s by default; under `anima-load` (embedded log,
/// 420 s) a page of 1,000 read the store in 23 ms on average, and 24 of 381 tries met a
/// checkpoint.
const PAGE_READS_WITHOUT_LOCK: usize = 2;

fn not_a_page_token() -> Status {
    Status::invalid_argument("page_token: not a next_page_token of this agent's subscriptions")
}

/// `INVALID_ARGUMENT` unless the fold knows `agent`.
fn known_agent(state: &anima_projections::State, agent: &str) -> Result<(), Status> {
    if state.agents.contains_key(agent) {
        return Ok(());
    }
    Err(Status::invalid_argument(format!("agent_id: unknown agent {}", anima_engine::validate::echo(agent))))
}

/// `Subscriptions.List` page sizes: when the request names none, and the most it may ask for.
const SUBSCRIPTIONS_PAGE_DEFAULT: usize = 500;
const SUBSCRIPTIONS_PAGE_MAX: usize = 1_000;
/// A page token is the checkpoint key of the page's last entry, a few bytes, in hex.
const PAGE_TOKEN_BYTES_MAX: usize = 16;

/// The checkpoint key a page token names; `None` when it is not hex or longer than a key.
fn decode_page_token(token: &str) -> Option<Vec<u8>> {
    (token.len() <= 2 * PAGE_TOKEN_BYTES_MAX).then(|| hex::decode(token).ok()).flatten()
}

/// The fields `MuteRequest` and `UnmuteRequest` share.
struct SubscriptionChange {
    agent_id: String,
    target: Option<api::SlackTarget>,
    chat_target: Option<api::ChatTarget>,
    request_id: String,
}

impl Services {
    /// Mutes or unmutes; returns where the change sits in the log.
    async fn change_subscription(
        &self,
        principal: &Principal,
        request: SubscriptionChange,
        mute: bool,
    ) -> Result<u64, Status> {
        principal.require_agent(&request.agent_id)?;
        let chat = request.chat_target.is_some();
        let target = match (request.target, request.chat_target) {
            (Some(slack), None) => Some(api::ReplyTarget { target: Some(api::reply_target::Target::Slack(slack)) }),
            (None, Some(chat)) => Some(api::ReplyTarget { target: Some(api::reply_target::Target::Chat(chat)) }),
            (None, None) => None,
            (Some(_), Some(_)) => {
                return Err(Status::invalid_argument("target, chat_target: set one of them, not both"))
            }
        };
        let seq = self
            .engine
            .change_subscription(&request.agent_id, target, mute, &request.request_id)
            .await
            .map_err(|error| status(if chat { naming_chat_target(error) } else { error }))?;
        Ok(seq)
    }
}

/// The engine names the fields of a chat target `target.*` (it takes a `ReplyTarget`); `Mute` and
/// `Unmute` carry that target as `chat_target`, so a refusal names it so.
fn naming_chat_target(error: CommandError) -> CommandError {
    match error {
        CommandError::InvalidArgument { field, reason } => {
            let field = match field {
                "target.tenant_id" => "chat_target.tenant_id",
                "target.chat_id" => "chat_target.chat_id",
                "target.thread_id" => "chat_target.thread_id",
                other => other,
            };
            CommandError::InvalidArgument { field, reason }
        }
        other => other,
    }
}
