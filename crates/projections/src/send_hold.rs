//! The send hold: before every irreversible post the agent asks, and the fold
//! decides at the request's place in the log. A send into a conversation that moved — foreign
//! rows after the agent's cursor — is held and the agent is shown what it missed; the cursor then
//! passes the tail, so a resend with nothing new posts. Because the verdict is the fold's at the
//! request's position, no send is ever allowed over a foreign message that precedes it in the
//! log. Any inconsistency fails closed. The draft itself never reaches the log.
//!
//! Guards come before the hold: while the agent's active wake is a memory pass, nothing is
//! posted (the pass is sealed); a post that would reach someone on the do-not-contact list is
//! refused ([`crate::do_not_contact`]); such refusals move no cursor.

use serde::{Deserialize, Serialize};

use crate::proto;
use crate::state::{LogPosition, State};
use crate::surface::SurfaceId;
use crate::text::{self, ROWS_SHOWN_MAX, TEXT_BYTES_MAX};
use crate::verdict::refused;
use crate::verdict::{HeldSend, PostKind, RefusalKind, SendVerdict, Verdict};

/// Confirmed posts remembered by the send that allowed them: a runtime's retry after a lost
/// response comes within seconds; 65,536 posts are hours of a busy fleet.
pub const POSTED_SENDS_MAX: usize = 65_536;

/// A post confirmed as the one a send allowed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PostedSend {
    pub agent: String,
    pub surface: SurfaceId,
    /// Slack: the post's ts; chat: the platform's message id.
    pub ts: String,
    pub confirmed_seq: u64,
}

impl State {
    /// Records that the send `send_event_id` was posted as `ts`; the first confirmation naming a
    /// send wins (a second post of one allowed send is the runtime's mistake, not a new fact).
    pub(crate) fn note_posted_send(&mut self, at: LogPosition, send_event_id: &str, posted: PostedSend) {
        if send_event_id.is_empty() || self.posted_sends.contains_key(send_event_id) {
            return;
        }
        self.posted_sends.insert(send_event_id.to_owned(), PostedSend { confirmed_seq: at.seq, ..posted });
        self.posted_send_order.insert(at.seq, send_event_id.to_owned());
        while self.posted_send_order.len() > POSTED_SENDS_MAX {
            if let Some((_, oldest)) = self.posted_send_order.pop_first() {
                self.posted_sends.remove(&oldest);
            }
        }
    }

    /// The post confirmed for the send with this event id, if one was (within the bound).
    pub fn posted_send(&self, send_event_id: &str) -> Option<&PostedSend> {
        self.posted_sends.get(send_event_id)
    }

    pub(crate) fn decide_send(&mut self, _at: LogPosition, request: &proto::SendRequested) -> Verdict {
        let agent = request.agent_id.as_str();
        if !self.agents.contains_key(&request.agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        if let Some(pass) = self.active_memory_pass(agent) {
            return refused(
                RefusalKind::FailedPrecondition,
                format!("a memory pass does not post: {agent}'s active wake is the memory pass {pass}"),
            );
        }
        let Some(surface) = request.target.as_ref().and_then(SurfaceId::from_target) else {
            return refused(RefusalKind::InvalidArgument, "target is missing");
        };
        if matches!(surface, SurfaceId::Linear { .. }) {
            return refused(RefusalKind::InvalidArgument, "a Linear session is answered with Sends.Respond, not Send");
        }
        if let Some(refusal) = self.check_do_not_contact(&surface, &request.mentioned_user_ids) {
            return Verdict::Send(SendVerdict::NotContacted(refusal));
        }
        let surface_key = self.ensure_surface_state(agent, &surface);
        let cursor_key = self.agent_keys.key(agent).zip(surface_key);
        let Some((cursor_key, cursor)) = cursor_key.and_then(|key| Some((key, self.cursor_by_key(key.0, key.1)?)))
        else {
            return Verdict::Send(SendVerdict::Allowed { surface, cursor_before: None, cursor_after: None });
        };
        let (tail, last_foreign) = match self.journal_by_key(cursor_key.1) {
            Some(journal) => (journal.tail, journal.last_foreign_ordinal(agent)),
            None => (0, 0),
        };
        if cursor > tail {
            return refused(
                RefusalKind::FailedPrecondition,
                format!("cursor {cursor} of {surface} is beyond its tail {tail}; refusing to decide"),
            );
        }
        if last_foreign <= cursor {
            let advance = match self.advance_cursor(cursor_key, tail) {
                Ok(advance) => advance,
                Err(broken) => return cursor_refusal(&surface, broken),
            };
            return Verdict::Send(SendVerdict::Allowed {
                surface,
                cursor_before: advance.before,
                cursor_after: Some(advance.after),
            });
        }
        self.ensure_rows_after(cursor_key.1, cursor);
        // Only foreign rows are new to the agent: its own rows after the cursor are neither
        // counted nor shown (the cursor passes them with the rest of the tail). Rows older than
        // the journal's window cannot be told apart any more and count as new.
        let (window_first, _) = self.journal_window(cursor_key.1);
        let mut new_messages = window_first.saturating_sub(cursor + 1);
        let mut budget = TEXT_BYTES_MAX.saturating_sub(text::held_frame_bytes_max());
        let mut shown = Vec::new();
        let mut showing = true;
        for ordinal in (cursor.max(window_first - 1) + 1..=tail).rev() {
            let Some(row) = self.journal_row(cursor_key.1, ordinal) else {
                return refused(
                    RefusalKind::FailedPrecondition,
                    format!("row {ordinal} of {surface} is missing from the journal window; refusing to decide"),
                );
            };
            if row.is_own(agent) {
                continue;
            }
            new_messages += 1;
            let bytes = row.bytes_for(agent);
            if shown.len() == ROWS_SHOWN_MAX || bytes > budget {
                showing = false;
            }
            if showing {
                budget -= bytes;
                shown.push(row.clone());
            }
        }
        shown.reverse();
        debug_assert!(!shown.is_empty() || new_messages > 0, "a hold has a foreign row after the cursor");
        let held = HeldSend {
            surface,
            kind: PostKind::of(request.kind),
            cursor_before: cursor,
            tail,
            new_messages,
            omitted: new_messages - shown.len() as u64,
            shown,
        };
        if let Err(broken) = self.advance_cursor(cursor_key, tail) {
            return cursor_refusal(&held.surface, broken);
        }
        Verdict::Send(SendVerdict::Held(held))
    }
}

/// A cursor move the rule forbids: fail closed, never allow.
fn cursor_refusal(surface: &SurfaceId, broken: crate::cursor::CursorRuleBroken) -> Verdict {
    refused(RefusalKind::FailedPrecondition, format!("{surface}: {broken}; refusing to decide"))
}
