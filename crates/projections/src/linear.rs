//! Linear agent sessions: session events become wakes whose reply target
//! is the session, and answers follow the response protocol.
//!
//! * `created` and `prompted` receipts queue a wake (reason `linear`, item id = receipt id) in the
//!   receiving agent's queue. The first receipt wins: receipts are remembered (bounded) and a
//!   redelivery is recorded without a wake.
//! * `stop` removes that session's queued items of the agent — not a running one — and leaves
//!   other sessions alone; its verdict names what it removed.
//! * A response request is keyed by hash(kind, body) and its sorted input ids. Its activity id is
//!   generated once, from the request's event id; a repeat with the same key gets the same
//!   activity id and state. While a response to some inputs has an unknown outcome, a different
//!   response to the same inputs is refused: it is never blindly re-sent.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::journal::row_meta;
use crate::proto;
use crate::row::BodyRef;
use crate::state::{
    LogPosition, State, LINEAR_ACTIVITIES_TAG, LINEAR_RECEIPTS_TAG, LINEAR_RECEIPT_ORDER_TAG, LINEAR_RESPONSES_TAG,
    LINEAR_RESPONSE_ORDER_TAG, LINEAR_SESSIONS_TAG, LINEAR_SESSION_ORDER_TAG,
};
use crate::surface::{linear_receipt_identity, LinearReceiptKind, SurfaceId};
use crate::time::log_seconds;
use crate::verdict::refused;
use crate::verdict::{LinearResponseVerdict, LinearSessionVerdict, RefusalKind, Verdict};
use crate::wake::{LinearWake, WakeItem, WakeReason};

/// Linear receipts remembered for the first-receipt-wins check, on top of the log's own window.
pub const LINEAR_RECEIPTS_MAX: usize = 65_536;
/// Linear responses remembered, oldest forgotten first. A forgotten response's key can be used
/// again; a forgotten unknown one no longer blocks (it is then weeks old at the rates expected).
pub const LINEAR_RESPONSES_MAX: usize = 65_536;
/// Receipts of Linear sessions remembered, per (agent, session), for the check that a response
/// answers a session the agent received: a session is forgotten once this many receipts came
/// after its newest one (it can then no longer be answered; at the rates expected it is then
/// weeks old). A session received again counts once, at its newest receipt.
pub const LINEAR_SESSIONS_MAX: usize = 65_536;
/// A window of the newest `MAX` entries, numbered as they come: entry `n` is checkpointed in
/// slot `n % MAX`, overwriting the entry it pushes out (the receipts, sessions and responses).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NumberedSlots<const MAX: u64>;

impl<T, const MAX: u64> crate::cold::Slots<u64, (u64, T)> for NumberedSlots<MAX> {
    fn slot(number: &u64) -> u64 {
        number % MAX
    }
    fn holds(number: &u64, (stored, _): &(u64, T)) -> bool {
        stored == number
    }
    fn key_of(_: u64, (number, _): &(u64, T)) -> u64 {
        *number
    }
}

pub type ReceiptSlots = NumberedSlots<{ LINEAR_RECEIPTS_MAX as u64 }>;
pub type SessionSlots = NumberedSlots<{ LINEAR_SESSIONS_MAX as u64 }>;
pub type ResponseSlots = NumberedSlots<{ LINEAR_RESPONSES_MAX as u64 }>;

/// Numbers `value` as the window's newest entry and returns the entry it pushes out of the
/// window, if any (read back from the store when it left memory).
fn push_numbered<T, const MAX: u64>(
    order: &mut crate::cold::ColdTable<u64, (u64, T), NumberedSlots<MAX>>,
    count: &mut crate::table::Table<(), u64>,
    tag: u8,
    cold: &crate::cold::Cold,
    value: T,
) -> Option<(u64, T)>
where
    T: Clone + Serialize + for<'de> Deserialize<'de>,
{
    let count = count.entry_or_default(());
    let number = *count;
    *count += 1;
    order.insert(number, (number, value));
    let oldest = number.checked_sub(MAX)?;
    order.ensure(tag, &oldest, cold);
    order.remove(&oldest)
}

/// Input ids one response may answer.
pub const LINEAR_RESPONSE_INPUTS_MAX: usize = 64;

/// What is known of a response's delivery to Linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinearResponseState {
    /// The activity id was handed out; no outcome reported yet.
    Requested,
    /// Linear accepted the activity.
    Accepted,
    /// The runtime could not tell whether Linear got it.
    Unknown,
}

impl LinearResponseState {
    pub fn as_str(self) -> &'static str {
        match self {
            LinearResponseState::Requested => "requested",
            LinearResponseState::Accepted => "accepted",
            LinearResponseState::Unknown => "unknown",
        }
    }
}

/// A response the fold handed an activity id to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearResponse {
    pub session_id: String,
    pub activity_id: String,
    pub state: LinearResponseState,
    pub requested_seq: u64,
}

/// That an agent received a Linear session (a created or prompted receipt), and whether a stop
/// came since. A stopped session may be answered again after a new receipt.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearSessionReceived {
    /// Log seq of the newest receipt.
    pub receipt_seq: u64,
    /// Log seq of a stop after it.
    pub stopped_seq: Option<u64>,
    /// The number of the newest receipt among the sessions' receipts (its place in the window
    /// of [`LINEAR_SESSIONS_MAX`]).
    pub number: u64,
}

/// Key of a response: (agent, sorted input ids joined by `\n`, hex sha-256 of kind and body).
pub type LinearResponseKey = (String, String, String);

impl State {
    /// A Linear session event as the receiving agent's app got it.
    pub(crate) fn observe_linear_session(&mut self, at: LogPosition, event: &proto::LinearSessionEvent) -> Verdict {
        let agent = event.receiving_agent_id.clone();
        if !self.agents.contains_key(&agent) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        if event.session_id.is_empty() || event.installation_id.is_empty() {
            return refused(RefusalKind::InvalidArgument, "session_id and installation_id must be set");
        }
        let session = SurfaceId::Linear { session: event.session_id.as_str().into() };
        let kind =
            proto::LinearSessionEventKind::try_from(event.kind).unwrap_or(proto::LinearSessionEventKind::Unspecified);
        let (receipt_kind, receipt_source) = match kind {
            proto::LinearSessionEventKind::Created => (LinearReceiptKind::Created, &event.session_id),
            proto::LinearSessionEventKind::Prompted if !event.agent_activity_id.is_empty() => {
                (LinearReceiptKind::Prompted, &event.agent_activity_id)
            }
            proto::LinearSessionEventKind::Prompted => {
                return refused(RefusalKind::InvalidArgument, "a prompted event needs its agent_activity_id")
            }
            proto::LinearSessionEventKind::Stop => return self.stop_linear_session(at, &agent, &event.session_id),
            proto::LinearSessionEventKind::Unspecified => {
                return refused(RefusalKind::InvalidArgument, "kind is unspecified")
            }
        };
        let receipt = linear_receipt_identity(&event.installation_id, receipt_kind, receipt_source);
        self.linear_receipts.ensure(LINEAR_RECEIPTS_TAG, &receipt, &self.cold);
        if self.linear_receipts.get(&receipt).is_some() {
            return Verdict::LinearSession(LinearSessionVerdict {
                agent,
                session: event.session_id.clone(),
                receipt: Some(receipt),
                duplicate_receipt: true,
                wake: None,
                not_queued: None,
                removed: Vec::new(),
            });
        }
        self.note_session_received(at, &agent, &event.session_id);
        self.remember_linear_receipt(at, &receipt);
        let body = BodyRef::linear(event);
        let item = WakeItem {
            id: receipt.clone(),
            reason: WakeReason::Linear,
            trigger_surface: session.clone(),
            trigger: row_meta(at, 0, &receipt, log_seconds(at.at_ns), "", "", None, body),
            reply_to: session,
            queued_seq: at.seq,
            queued_at_ns: at.at_ns,
            resume_after_restart: false,
            note: None,
            linear: Some(LinearWake {
                kind: receipt_kind,
                session_id: event.session_id.clone(),
                agent_activity_id: event.agent_activity_id.clone(),
                issue_identifier: event.issue_identifier.clone(),
                issue_url: event.issue_url.clone(),
            }),
            memory: None,
            extras: crate::text::ExtrasSizes::default(),
        };
        let queued = self.queue_wake(at, &agent, item);
        Verdict::LinearSession(LinearSessionVerdict {
            agent,
            session: event.session_id.clone(),
            receipt: Some(receipt),
            duplicate_receipt: false,
            wake: queued.ok(),
            not_queued: queued.err(),
            removed: Vec::new(),
        })
    }

    /// Remembers a new receipt, forgetting the oldest beyond [`LINEAR_RECEIPTS_MAX`].
    fn remember_linear_receipt(&mut self, at: LogPosition, receipt: &str) {
        self.linear_receipts.insert(receipt.to_owned(), at.seq);
        let (order, count) = (&mut self.linear_receipt_order, &mut self.linear_receipt_count);
        if let Some((_, forgotten)) =
            push_numbered(order, count, LINEAR_RECEIPT_ORDER_TAG, &self.cold, receipt.to_owned())
        {
            // Each remembered receipt has its one order entry (a receipt is remembered only
            // when it is not already), so the oldest is present: forgotten unread.
            self.linear_receipts.forget_present(forgotten);
        }
    }

    /// Remembers a new response, forgetting the oldest beyond [`LINEAR_RESPONSES_MAX`].
    fn remember_linear_response(&mut self, key: LinearResponseKey) {
        let (order, count) = (&mut self.linear_response_order, &mut self.linear_response_count);
        let Some((_, key)) = push_numbered(order, count, LINEAR_RESPONSE_ORDER_TAG, &self.cold, key) else { return };
        self.linear_responses.ensure(LINEAR_RESPONSES_TAG, &key, &self.cold);
        if let Some(forgotten) = self.linear_responses.remove(&key) {
            self.linear_activities.ensure_for_write(LINEAR_ACTIVITIES_TAG, &forgotten.activity_id, &self.cold);
            self.linear_activities.forget(forgotten.activity_id);
        }
        self.linear_unknown_responses.remove(&key);
    }

    /// Remembers that `agent` received the session (again), forgetting the oldest beyond the
    /// bound.
    fn note_session_received(&mut self, at: LogPosition, agent: &str, session_id: &str) {
        let key = (agent.to_owned(), session_id.to_owned());
        let number = self.linear_session_count.get(&()).copied().unwrap_or(0);
        self.linear_sessions.ensure_for_write(LINEAR_SESSIONS_TAG, &key, &self.cold);
        self.linear_sessions
            .insert(key.clone(), LinearSessionReceived { receipt_seq: at.seq, stopped_seq: None, number });
        // A session received again keeps the slot of its earlier receipt, which no longer
        // names its newest: that slot forgets nothing when it leaves the window.
        let (order, count) = (&mut self.linear_session_order, &mut self.linear_session_count);
        if let Some((oldest, key)) = push_numbered(order, count, LINEAR_SESSION_ORDER_TAG, &self.cold, key) {
            self.linear_sessions.ensure(LINEAR_SESSIONS_TAG, &key, &self.cold);
            if self.linear_sessions.get(&key).is_some_and(|received| received.number == oldest) {
                self.linear_sessions.remove(&key);
            }
        }
    }

    /// Removes the session's queued items of the agent; a running (or claimed) one stays. The
    /// session can no longer be answered until it is received again.
    fn stop_linear_session(&mut self, at: LogPosition, agent: &str, session_id: &str) -> Verdict {
        self.ensure_queue(agent);
        let key = (agent.to_owned(), session_id.to_owned());
        self.linear_sessions.ensure(LINEAR_SESSIONS_TAG, &key, &self.cold);
        let stopped = self
            .linear_sessions
            .get(&key)
            .filter(|received| received.stopped_seq.is_none())
            .map(|received| LinearSessionReceived { stopped_seq: Some(at.seq), ..received.clone() });
        if let Some(stopped) = stopped {
            self.linear_sessions.insert(key, stopped);
        }
        let of_session = |item: &WakeItem| item.linear.as_ref().is_some_and(|l| l.session_id == session_id);
        // Only a queue that holds some of the session's items is touched (and so checkpointed).
        let touched = self.queues.get(agent).is_some_and(|q| q.queued().any(of_session));
        let removed = match self.queues.get_mut(agent) {
            Some(queue) if touched => queue.retain(|i| !of_session(i)),
            _ => Vec::new(),
        };
        Verdict::LinearSession(LinearSessionVerdict {
            agent: agent.to_owned(),
            session: session_id.to_owned(),
            receipt: None,
            duplicate_receipt: false,
            wake: None,
            not_queued: None,
            removed,
        })
    }

    /// Decides a response request.
    pub(crate) fn request_linear_response(
        &mut self,
        at: LogPosition,
        event_id: &str,
        request: &proto::LinearResponseRequested,
    ) -> Verdict {
        if !self.agents.contains_key(&request.agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {:?} is not registered", request.agent_id));
        }
        if request.session_id.is_empty() {
            return refused(RefusalKind::InvalidArgument, "session_id is empty");
        }
        if let Some(pass) = self.active_memory_pass(&request.agent_id) {
            return refused(
                RefusalKind::FailedPrecondition,
                format!("a memory pass does not post: {}'s active wake is the memory pass {pass}", request.agent_id),
            );
        }
        let kind = proto::LinearResponseKind::try_from(request.kind).unwrap_or(proto::LinearResponseKind::Unspecified);
        if kind == proto::LinearResponseKind::Unspecified {
            return refused(RefusalKind::InvalidArgument, "kind is unspecified");
        }
        // A runtime answers only sessions it was given, and not after a stop. The agent's active
        // wake for the session is proof of receipt too: receipts are bounded, and under a long
        // queue the receipt of a session can be forgotten before its wake is claimed.
        let session_key = (request.agent_id.clone(), request.session_id.clone());
        let active_for_session = self
            .queue(&request.agent_id)
            .and_then(|queue| queue.active.as_ref())
            .and_then(|active| active.item.linear.as_ref())
            .is_some_and(|linear| linear.session_id == request.session_id);
        self.linear_sessions.ensure(LINEAR_SESSIONS_TAG, &session_key, &self.cold);
        match self.linear_sessions.get(&session_key) {
            None if active_for_session => {}
            None => {
                return refused(
                    RefusalKind::FailedPrecondition,
                    format!(
                        "agent {:?} never received Linear session {}; it can answer only sessions it was given",
                        request.agent_id, request.session_id
                    ),
                )
            }
            Some(LinearSessionReceived { stopped_seq: Some(stopped), .. }) => {
                return refused(
                    RefusalKind::FailedPrecondition,
                    format!(
                        "Linear session {} was stopped (seq {stopped}); it can be answered again after a new prompt",
                        request.session_id
                    ),
                )
            }
            Some(_) => {}
        }
        let mut inputs = request.input_ids.clone();
        inputs.sort();
        inputs.dedup();
        let inputs_key = inputs.join("\n");
        let key: LinearResponseKey = (request.agent_id.clone(), inputs_key.clone(), content_hash(kind, &request.body));
        self.linear_responses.ensure(LINEAR_RESPONSES_TAG, &key, &self.cold);
        if let Some(existing) = self.linear_responses.get(&key) {
            return Verdict::LinearResponse(LinearResponseVerdict {
                activity_id: existing.activity_id.clone(),
                state: existing.state,
                repeated: true,
            });
        }
        let same_inputs = (request.agent_id.clone(), inputs_key.clone(), String::new())
            ..(request.agent_id.clone(), format!("{inputs_key}\u{0}"), String::new());
        let unknown = self
            .linear_unknown_responses
            .range(same_inputs)
            .find(|((_, inputs, _), _)| *inputs == inputs_key)
            .map(|(_, activity)| activity.clone());
        if let Some(activity) = unknown {
            return refused(
                RefusalKind::FailedPrecondition,
                format!(
                    "an earlier response to these inputs (activity {activity}) has an unknown outcome; repeat that exact response, or check Linear and confirm its outcome first"
                ),
            );
        }
        let activity_id = activity_id_for(event_id);
        self.linear_responses.insert(
            key.clone(),
            LinearResponse {
                session_id: request.session_id.clone(),
                activity_id: activity_id.clone(),
                state: LinearResponseState::Requested,
                requested_seq: at.seq,
            },
        );
        self.linear_activities.insert(activity_id.clone(), key.clone());
        self.remember_linear_response(key);
        Verdict::LinearResponse(LinearResponseVerdict {
            activity_id,
            state: LinearResponseState::Requested,
            repeated: false,
        })
    }

    /// Records what the runtime learned of a response. Accepted is final.
    pub(crate) fn record_linear_response_outcome(&mut self, request: &proto::LinearResponseOutcome) -> Verdict {
        let result =
            proto::LinearResponseResult::try_from(request.result).unwrap_or(proto::LinearResponseResult::Unspecified);
        let reported = match result {
            proto::LinearResponseResult::Accepted => LinearResponseState::Accepted,
            proto::LinearResponseResult::Unknown => LinearResponseState::Unknown,
            proto::LinearResponseResult::Unspecified => {
                return refused(RefusalKind::InvalidArgument, "result is unspecified")
            }
        };
        self.linear_activities.ensure(LINEAR_ACTIVITIES_TAG, &request.activity_id, &self.cold);
        let Some(key) = self.linear_activities.get(&request.activity_id).cloned() else {
            return refused(RefusalKind::InvalidArgument, "activity_id: no response with that activity id is known");
        };
        if key.0 != request.agent_id {
            return refused(RefusalKind::InvalidArgument, "activity_id: that activity belongs to another agent");
        }
        self.linear_responses.ensure(LINEAR_RESPONSES_TAG, &key, &self.cold);
        let Some(response) = self.linear_responses.get(&key) else {
            return refused(RefusalKind::FailedPrecondition, "the response of that activity is gone");
        };
        let state = match response.state {
            LinearResponseState::Accepted => LinearResponseState::Accepted,
            _ => reported,
        };
        if state != response.state {
            let changed = LinearResponse { state, ..response.clone() };
            self.linear_responses.insert(key.clone(), changed);
        }
        match state {
            LinearResponseState::Unknown => self.linear_unknown_responses.insert(key, request.activity_id.clone()),
            _ => self.linear_unknown_responses.remove(&key),
        };
        Verdict::LinearResponse(LinearResponseVerdict {
            activity_id: request.activity_id.clone(),
            state,
            repeated: false,
        })
    }
}

/// Hex sha-256 of a response's kind and body.
fn content_hash(kind: proto::LinearResponseKind, body: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(kind.as_str_name().as_bytes());
    hasher.update([0]);
    hasher.update(body.as_bytes());
    hex(&hasher.finalize())
}

/// A UUID-shaped activity id derived from the request's event id (version 8, RFC 9562 variant):
/// every instance folding the log generates the same one, once.
fn activity_id_for(event_id: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(b"linear-activity\0");
    hasher.update(event_id.as_bytes());
    let digest = hasher.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    bytes[6] = (bytes[6] & 0x0f) | 0x80;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex = hex(&bytes);
    format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
