//! The send hold (DESIGN §4.7): before every irreversible post the agent asks, and the fold
//! decides at the request's place in the log. A send into a conversation that moved — foreign
//! rows after the agent's cursor — is held and the agent is shown what it missed; the cursor then
//! passes the tail, so a resend with nothing new posts. Because the verdict is the fold's at the
//! request's position, no send is ever allowed over a foreign message that precedes it in the
//! log. Any inconsistency fails closed. The draft itself never reaches the log.

use crate::fold::refused;
use crate::proto;
use crate::render::{self, ROWS_SHOWN_MAX, TEXT_BYTES_MAX};
use crate::state::{LogPosition, State};
use crate::surface::SurfaceId;
use crate::verdict::{HeldSend, RefusalKind, SendVerdict, Verdict};

impl State {
    pub(crate) fn decide_send(&mut self, _at: LogPosition, request: &proto::SendRequested) -> Verdict {
        let agent = request.agent_id.as_str();
        if !self.agents.contains_key(&request.agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        let Some(surface) = request.target.as_ref().and_then(SurfaceId::from_target) else {
            return refused(RefusalKind::InvalidArgument, "target is missing");
        };
        if matches!(surface, SurfaceId::Linear { .. }) {
            return refused(RefusalKind::InvalidArgument, "a Linear session is answered with Sends.Respond, not Send");
        }
        let cursor_key = self.agent_keys.key(agent).zip(self.surfaces.key(&surface));
        let Some((cursor_key, cursor)) = cursor_key.and_then(|key| Some((key, self.cursors.get(&key).copied()?)))
        else {
            return Verdict::Send(SendVerdict::Allowed { surface, cursor_before: None, cursor_after: None });
        };
        let (tail, last_foreign) = match self.journals.get(&cursor_key.1) {
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
            self.cursors.insert(cursor_key, tail);
            return Verdict::Send(SendVerdict::Allowed {
                surface,
                cursor_before: Some(cursor),
                cursor_after: Some(tail),
            });
        }
        let journal = self.journals.get(&cursor_key.1).expect("tail > 0 implies a journal");
        let mut budget = TEXT_BYTES_MAX.saturating_sub(render::held_frame_bytes_max());
        let mut shown = Vec::new();
        for ordinal in (cursor + 1..=tail).rev() {
            if shown.len() == ROWS_SHOWN_MAX {
                break;
            }
            let Some(row) = journal.row(ordinal) else {
                return refused(
                    RefusalKind::FailedPrecondition,
                    format!("row {ordinal} of {surface} is missing from the journal window; refusing to decide"),
                );
            };
            let bytes = row.bytes_for(agent);
            if bytes > budget {
                break;
            }
            budget -= bytes;
            shown.push(row.clone());
        }
        shown.reverse();
        let new_messages = tail - cursor;
        let held = HeldSend {
            surface,
            cursor_before: cursor,
            tail,
            new_messages,
            omitted: new_messages - shown.len() as u64,
            shown,
        };
        self.cursors.insert(cursor_key, tail);
        Verdict::Send(SendVerdict::Held(held))
    }
}
