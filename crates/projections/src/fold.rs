//! The fold: applies one stored event at its place in the log and records the verdict for it.
//!
//! Every decision is made here, from the state at that position; time is the log's timestamp of
//! the event (made monotonic). Observations are folded into journals and routed in the same
//! step; requests (send, claim, start, finish) are judged and their verdicts recorded under the
//! event's sequence.

use prost::Message;

use crate::intern::SurfaceKey;
use crate::journal::row_meta;
use crate::journal::RowMeta;
use crate::proto::{self, envelope::Payload};
use crate::row::BodyRef;
use crate::state::{AgentRecord, Halt, LogPosition, State, IDENTITIES_PER_SURFACE_MAX, READER_VERSION};
use crate::subscription::{mentions, Observed, Route};
use crate::surface::{chat_message_identity, slack_message_identity, ChatKind, SurfaceId};
use crate::time::log_seconds;
use crate::verdict::{refused, JournalVerdict, RefusalKind, Verdict};
use crate::wake::{NotQueued, WakeItem};

/// Slack subtypes that are journal rows; edits, deletes and joins are recorded but not rows.
const OBSERVABLE_SUBTYPES: [&str; 3] = ["", "bot_message", "file_share"];

impl State {
    /// Decodes and applies one stored event. A payload that does not decode stops the fold
    /// (fail closed): it cannot know what it skipped.
    pub fn apply_bytes(&mut self, at: LogPosition, bytes: &[u8]) {
        match proto::Envelope::decode(bytes) {
            Ok(envelope) => self.apply(at, &envelope),
            Err(e) => {
                if self.meta.halted.is_none() {
                    self.meta.halted = Some(Halt { seq: at.seq, reason: format!("event does not decode: {e}") });
                }
            }
        }
    }

    /// Applies one event at its log position and records its verdict.
    pub fn apply(&mut self, at: LogPosition, envelope: &proto::Envelope) {
        if self.meta.halted.is_some() || at.seq <= self.meta.applied_seq {
            return;
        }
        let at = LogPosition { seq: at.seq, at_ns: at.at_ns.max(self.meta.last_at_ns) };
        self.meta.applied_seq = at.seq;
        self.meta.last_at_ns = at.at_ns;
        let verdict = match envelope.payload.as_ref() {
            Some(Payload::AgentRegistered(registration)) => self.register_agent(at, registration),
            Some(Payload::SlackMessage(message)) => self.observe_slack_message(at, message),
            Some(Payload::Send(request)) => self.decide_send(at, request),
            Some(Payload::SendConfirmed(confirmation)) => self.confirm_send(at, confirmation),
            Some(Payload::WakeClaim(request)) => self.claim_wake(at, request),
            Some(Payload::WakeStart(request)) => self.start_wake(at, request),
            Some(Payload::WakeFinish(request)) => self.finish_wake(at, request),
            Some(Payload::SubscriptionChange(request)) => self.change_subscription(at, request),
            Some(Payload::WakeHeartbeat(request)) => self.record_heartbeat(at, request),
            Some(Payload::WakeRecovery(request)) => self.recover_wake(at, request),
            Some(Payload::ChatMessage(message)) => self.observe_chat_message(at, message),
            Some(Payload::LinearSession(event)) => self.observe_linear_session(at, event),
            Some(Payload::LinearResponse(request)) => self.request_linear_response(at, &envelope.event_id, request),
            Some(Payload::LinearResponseOutcome(outcome)) => self.record_linear_response_outcome(outcome),
            Some(Payload::MemoryConfig(config)) => self.configure_memory(config),
            Some(Payload::MemoryPass(request)) => self.request_memory_pass(at, request),
            Some(Payload::SlackThreadStop(stop)) => self.stop_slack_thread(stop),
            Some(Payload::DoNotContact(config)) => self.configure_do_not_contact(config),
            None if envelope.min_reader_version > READER_VERSION => {
                self.meta.halted = Some(Halt {
                    seq: at.seq,
                    reason: format!(
                        "event {} needs reader version {} (this fold reads {READER_VERSION}); upgrade this instance",
                        envelope.event_id, envelope.min_reader_version
                    ),
                });
                return;
            }
            None => return,
        };
        // The window is one of sequences, not of verdicts (some events record none).
        self.verdicts.record(at.seq, crate::state::KeptVerdict::new(verdict));
    }

    fn register_agent(&mut self, at: LogPosition, registration: &proto::AgentRegistered) -> Verdict {
        if registration.agent_id.is_empty() {
            return refused(RefusalKind::InvalidArgument, "agent_id is empty");
        }
        if let Some(old) = self.agents.get(&registration.agent_id).cloned() {
            for key in identity_keys(&old.slack_bot_user_id, &old.slack_bot_id) {
                if self.slack_identities.get(&key) == Some(&registration.agent_id) {
                    self.slack_identities.remove(&key);
                }
            }
        }
        if let Some(old) = self.agents.get(&registration.agent_id).cloned() {
            if !old.chat_user_id.is_empty()
                && self.chat_identities.get(&old.chat_user_id) == Some(&registration.agent_id)
            {
                self.chat_identities.remove(&old.chat_user_id);
            }
        }
        for key in identity_keys(&registration.slack_bot_user_id, &registration.slack_bot_id) {
            self.slack_identities.insert(key, registration.agent_id.clone());
        }
        if !registration.chat_user_id.is_empty() {
            self.chat_identities.insert(registration.chat_user_id.clone(), registration.agent_id.clone());
        }
        self.agents.insert(
            registration.agent_id.clone(),
            AgentRecord {
                slack_bot_user_id: registration.slack_bot_user_id.clone(),
                slack_bot_id: registration.slack_bot_id.clone(),
                display_name: registration.display_name.clone(),
                chat_user_id: registration.chat_user_id.clone(),
                registered_seq: at.seq,
            },
        );
        Verdict::AgentRegistered
    }

    /// The agent a Slack author belongs to: its user id is an agent's bot user id, or its bot id
    /// is an agent's bot id or bot user id.
    fn slack_owner(&self, user_id: &str, bot_id: &str) -> Option<crate::surface::Id> {
        // One key buffer for the (up to three) lookups of every message.
        let mut key = String::with_capacity(2 + user_id.len().max(bot_id.len()));
        for (prefix, id) in [("u:", user_id), ("b:", bot_id), ("u:", bot_id)] {
            if id.is_empty() {
                continue;
            }
            key.clear();
            key.push_str(prefix);
            key.push_str(id);
            if let Some(agent) = self.slack_identities.get(key.as_str()) {
                return Some(agent.as_str().into());
            }
        }
        None
    }

    fn observe_slack_message(&mut self, at: LogPosition, message: &proto::SlackMessageObserved) -> Verdict {
        let agent = message.receiving_agent_id.clone();
        let kind_ok = matches!(
            proto::SlackDeliveryKind::try_from(message.kind),
            Ok(proto::SlackDeliveryKind::Message | proto::SlackDeliveryKind::AppMention)
        );
        let has_author = !message.user_id.is_empty() || !message.bot_id.is_empty();
        let has_content = !message.text.trim().is_empty() || !message.files.is_empty();
        let Some(ts_seconds) = crate::time::slack_ts_seconds(&message.ts) else {
            return not_journaled(agent);
        };
        if !kind_ok
            || message.team_id.is_empty()
            || message.channel_id.is_empty()
            || !OBSERVABLE_SUBTYPES.contains(&message.subtype.as_str())
            || !has_author
            || !has_content
        {
            return not_journaled(agent);
        }
        let surface = SurfaceId::slack_message(&message.team_id, &message.channel_id, &message.ts, &message.thread_ts);
        let app_mention = message.kind == proto::SlackDeliveryKind::AppMention as i32;
        self.journal_and_route(
            at,
            Incoming {
                agent,
                owner: self.slack_owner(&message.user_id, &message.bot_id),
                direct: surface.is_slack_dm(),
                surface,
                id: &message.ts,
                ts_seconds,
                user_id: &message.user_id,
                bot_id: &message.bot_id,
                body: BodyRef::slack(message),
                mentions: &|record: &AgentRecord| app_mention || mentions(&message.text, &record.slack_bot_user_id),
                is_bot: !message.bot_id.is_empty() || message.subtype == "bot_message",
                identity: slack_message_identity(&message.team_id, &message.channel_id, &message.ts),
            },
        )
    }

    fn confirm_send(&mut self, at: LogPosition, confirmation: &proto::SendConfirmed) -> Verdict {
        let agent = confirmation.agent_id.clone();
        let Some(record) = self.agents.get(&agent).cloned() else {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        };
        let Some(surface) = confirmation.target.as_ref().and_then(SurfaceId::from_target) else {
            return refused(RefusalKind::InvalidArgument, "target is missing");
        };
        // Slack posts are placed by their ts; chat posts (whose `ts` is the platform's message
        // id) by the log's time, like every chat row.
        let (ts_seconds, user_id, bot_id) = match &surface {
            SurfaceId::Slack { .. } => match crate::time::slack_ts_seconds(&confirmation.ts) {
                Some(seconds) => (seconds, record.slack_bot_user_id.clone(), record.slack_bot_id.clone()),
                None => return refused(RefusalKind::InvalidArgument, "ts is not a Slack ts"),
            },
            SurfaceId::Chat { .. } if confirmation.ts.is_empty() => {
                return refused(RefusalKind::InvalidArgument, "the chat message id of the post is empty")
            }
            SurfaceId::Chat { .. } => (log_seconds(at.at_ns), record.chat_user_id.clone(), String::new()),
            SurfaceId::Linear { .. } => {
                return refused(
                    RefusalKind::InvalidArgument,
                    "a Linear response is confirmed with Sends.ConfirmResponse",
                )
            }
            SurfaceId::Memory { .. } => return refused(RefusalKind::InvalidArgument, "target is not a conversation"),
        };
        let posted = crate::send_hold::PostedSend {
            agent: agent.clone(),
            surface: surface.clone(),
            ts: confirmation.ts.clone(),
            confirmed_seq: at.seq,
        };
        self.note_posted_send(at, &confirmation.send_event_id, posted);
        let surface_key = self.intern_surface(&surface);
        let existing = self.identity_ordinal(surface_key, &confirmation.ts);
        let ordinal = match existing {
            Some(ordinal) => ordinal,
            None => {
                let body = BodyRef::confirmed(confirmation);
                let ordinal = self.journal_tail(surface_key) + 1;
                let row = row_meta(
                    at,
                    ordinal,
                    &confirmation.ts,
                    ts_seconds,
                    &user_id,
                    &bot_id,
                    Some(agent.as_str().into()),
                    body,
                );
                self.journal_new_row(surface_key, row);
                if confirmation.kind != proto::SendKind::File as i32 {
                    self.note_own_post(at, &agent, &surface, &confirmation.ts);
                }
                self.note_memory_history(at, &agent);
                ordinal
            }
        };
        let notices_settled = self.settle_failure_notices(&agent, &surface);
        Verdict::Journaled(JournalVerdict {
            agent,
            surface: Some(surface),
            ordinal,
            duplicate_message: existing.is_some(),
            wake: None,
            route: None,
            not_queued: None,
            notices_settled,
        })
    }

    /// A chat message as one agent's app received it: journaled once per
    /// identity (tenant, chat, message id) on its surface, then routed for the receiving agent
    /// like a Slack message — p2p chats as DMs.
    fn observe_chat_message(&mut self, at: LogPosition, message: &proto::ChatMessageObserved) -> Verdict {
        let agent = message.receiving_agent_id.clone();
        let Some(kind) = ChatKind::from_proto(message.chat_kind) else {
            return not_journaled(agent);
        };
        let has_content = !message.text.trim().is_empty() || !message.files.is_empty();
        if message.tenant_id.is_empty()
            || message.chat_id.is_empty()
            || message.message_id.is_empty()
            || message.sender_id.is_empty()
            || !has_content
        {
            return not_journaled(agent);
        }
        let surface =
            SurfaceId::chat_message(&message.tenant_id, &message.chat_id, &message.message_id, &message.thread_id);
        let chat = self.intern_surface(&surface.top_level());
        self.chat_kinds.ensure(crate::state::CHAT_KINDS_TAG, &chat, &self.cold);
        if self.chat_kinds.get(&chat) != Some(&kind) {
            self.chat_kinds.insert(chat, kind);
        }
        self.journal_and_route(
            at,
            Incoming {
                agent,
                owner: self.chat_identities.get(&message.sender_id).map(|agent| agent.as_str().into()),
                direct: kind == ChatKind::P2p,
                surface,
                id: &message.message_id,
                ts_seconds: log_seconds(at.at_ns),
                user_id: &message.sender_id,
                bot_id: "",
                body: BodyRef::chat(message),
                mentions: &|record: &AgentRecord| {
                    !record.chat_user_id.is_empty() && message.mentioned_user_ids.contains(&record.chat_user_id)
                },
                is_bot: message.sender_is_bot,
                identity: chat_message_identity(&message.tenant_id, &message.chat_id, &message.message_id),
            },
        )
    }

    /// Journals an incoming message once per identity on its surface, then, for a registered
    /// receiving agent, notes its own post and routes it; one path for every platform.
    fn journal_and_route(&mut self, at: LogPosition, incoming: Incoming<'_>) -> Verdict {
        let Incoming {
            agent,
            surface,
            id,
            ts_seconds,
            user_id,
            bot_id,
            owner,
            body,
            direct,
            mentions,
            is_bot,
            identity,
        } = incoming;
        let surface_key = self.intern_surface(&surface);
        if direct && !is_bot && owner.is_none() {
            let dm =
                if surface.thread_ts().is_none() { surface_key } else { self.intern_surface(&surface.top_level()) };
            self.note_dm_member(dm, user_id);
        }
        let existing = self.identity_ordinal(surface_key, id);
        let ordinal = existing.unwrap_or_else(|| self.journal_tail(surface_key) + 1);
        let row = row_meta(at, ordinal, id, ts_seconds, user_id, bot_id, owner, body);
        if existing.is_none() {
            self.journal_new_row(surface_key, row.clone());
        }
        let mut wake = None;
        let mut route = None;
        let mut not_queued = None;
        if let Some(mentioned) = self.agents.get(&agent).map(mentions) {
            if row.is_own(&agent) && existing.is_none() {
                self.note_own_post(at, &agent, &surface, id);
            }
            let observed = Observed { surface: &surface, row: &row, direct, mentioned, is_bot, text: body.text };
            (route, wake, not_queued) = self.route_and_queue(at, &agent, &observed, body, identity);
        }
        Verdict::Journaled(JournalVerdict {
            agent,
            surface: Some(surface),
            ordinal,
            duplicate_message: existing.is_some(),
            wake,
            route,
            not_queued,
            notices_settled: Vec::new(),
        })
    }

    /// Routes an observed message for one agent and queues the wake it earns, if any; one path
    /// for every platform.
    fn route_and_queue(
        &mut self,
        at: LogPosition,
        agent: &str,
        observed: &Observed<'_>,
        body: BodyRef<'_>,
        identity: String,
    ) -> (Option<Route>, Option<crate::wake::WakeReason>, Option<NotQueued>) {
        let routed = self.route(agent, observed);
        let Route::Wake(reason) = routed.route else { return (Some(routed.route), None, None) };
        let Some(reply_to) = routed.reply_to else { return (Some(routed.route), None, None) };
        let item = WakeItem {
            id: identity,
            reason,
            trigger_surface: observed.surface.clone(),
            trigger: observed.row.clone(),
            reply_to,
            queued_seq: at.seq,
            queued_at_ns: at.at_ns,
            resume_after_restart: false,
            note: None,
            linear: None,
            memory: None,
            extras: crate::text::ExtrasSizes::of(body),
        };
        match self.queue_wake(at, agent, item) {
            Ok(reason) => (Some(routed.route), Some(reason), None),
            Err(not_queued) => (Some(routed.route), None, Some(not_queued)),
        }
    }

    /// The ordinal a message identity was journaled at, if it is in the surface's dedupe window.
    fn identity_ordinal(&mut self, surface: SurfaceKey, ts: &str) -> Option<u64> {
        let key = (surface, crate::surface::Id::from(ts));
        self.identities.ensure(crate::state::IDENTITIES_TAG, &key, &self.cold);
        self.identities.get(&key).copied()
    }

    /// Appends a new row and remembers its identity, forgetting the surface's oldest one beyond
    /// the dedupe window.
    fn journal_new_row(&mut self, surface: SurfaceKey, row: RowMeta) {
        let ordinal = row.ordinal;
        let ts = row.ts.clone();
        self.push_row(surface, row);
        self.identities.insert((surface, ts.clone()), ordinal);
        self.identity_order.insert((surface, ordinal), (ordinal, ts));
        if ordinal > IDENTITIES_PER_SURFACE_MAX {
            let oldest = (surface, ordinal - IDENTITIES_PER_SURFACE_MAX);
            // The oldest's slot page holds the surface's next three oldest too, forgotten at its
            // next messages: one read for four, as for the settle order (in a 10-minute
            // `anima-load` run the identity order was the most often slow read back, README
            // stop 51).
            self.identity_order.ensure_with_page(crate::state::IDENTITY_ORDER_TAG, &oldest, &self.cold);
            if let Some((_, old_ts)) = self.identity_order.remove(&oldest) {
                // Each identity has its one order entry (a row is journaled only for an identity
                // not in the window), so the oldest's identity is present: forgotten unread.
                self.identities.forget_present((surface, old_ts));
            }
        }
    }
}

/// A message as a platform delivered it, reduced to what journaling and routing need.
struct Incoming<'a> {
    agent: String,
    surface: SurfaceId,
    /// Its identity on the surface: the Slack ts, or the chat message id.
    id: &'a str,
    /// The time shown for the row.
    ts_seconds: i64,
    user_id: &'a str,
    bot_id: &'a str,
    /// The agent the author is, if any.
    owner: Option<crate::surface::Id>,
    body: BodyRef<'a>,
    /// A direct conversation (Slack DM, p2p chat).
    direct: bool,
    /// Whether it mentions the receiving agent, given its record.
    mentions: &'a dyn Fn(&AgentRecord) -> bool,
    is_bot: bool,
    /// The wake item id it would queue.
    identity: String,
}

/// The verdict of an observation that is recorded but not journaled.
fn not_journaled(agent: String) -> Verdict {
    Verdict::Journaled(JournalVerdict {
        agent,
        surface: None,
        ordinal: 0,
        duplicate_message: false,
        wake: None,
        route: None,
        not_queued: None,
        notices_settled: Vec::new(),
    })
}

/// Identity-table keys of an agent's Slack identities.
fn identity_keys(bot_user_id: &str, bot_id: &str) -> Vec<String> {
    let mut keys = Vec::new();
    if !bot_user_id.is_empty() {
        keys.push(format!("u:{bot_user_id}"));
    }
    if !bot_id.is_empty() {
        keys.push(format!("b:{bot_id}"));
    }
    keys
}
