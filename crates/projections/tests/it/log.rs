//! The test log: stamps each event with the next sequence and a log time, resolves starts and
//! finishes left open by [`crate::events::start`] / [`crate::events::finish`] from the agent's
//! active wake, folds it, and keeps every folded event so bodies can be read back by sequence
//! (as the engine reads them from the log when it renders).
//!
//! Log time: the event's source clock (`occurred_at_ms`) when a test set it, else one second after
//! the previous event; never backwards.

use anima_projections::journal::{RowBody, RowMeta};
use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::verdict::{Refusal, Verdict};
use anima_projections::wake::PlanEntry;
use anima_projections::{LogPosition, State};

use crate::events::{FROM_STATE, LOG_START_MS};

const NS_PER_MS: i64 = 1_000_000;
const NS_PER_SECOND: i64 = 1_000_000_000;

#[derive(Default)]
pub struct TestLog {
    pub state: State,
    /// Every folded event, resolved; `events[seq - 1]`.
    pub events: Vec<Envelope>,
    /// Where each event was folded; `positions[seq - 1]`.
    pub positions: Vec<LogPosition>,
    last_at_ns: i64,
}

impl TestLog {
    pub fn new() -> Self {
        TestLog::default()
    }

    /// A log with `given` folded at sequences 1..=n.
    pub fn with(given: &[Envelope]) -> Self {
        let mut log = TestLog::new();
        for event in given {
            log.fold(event.clone());
        }
        log
    }

    /// Folds the next event and returns its sequence.
    pub fn fold(&mut self, event: Envelope) -> u64 {
        let event = self.resolve(event);
        let seq = self.events.len() as u64 + 1;
        let at_ns = if event.occurred_at_ms != 0 {
            event.occurred_at_ms * NS_PER_MS
        } else if self.last_at_ns == 0 {
            LOG_START_MS * NS_PER_MS
        } else {
            self.last_at_ns + NS_PER_SECOND
        }
        .max(self.last_at_ns + 1);
        self.last_at_ns = at_ns;
        let at = LogPosition { seq, at_ns };
        self.state.apply(at, &event);
        self.events.push(event);
        self.positions.push(at);
        seq
    }

    /// Fills in a start's item and plan, or the item of a finish, a heartbeat or a recovery
    /// request, from the agent's active wake.
    fn resolve(&self, mut event: Envelope) -> Envelope {
        if event.source != FROM_STATE {
            return event;
        }
        match event.payload.as_mut() {
            Some(Payload::WakeStart(start)) => {
                if let Some(active) = self.state.queue(&start.agent_id).and_then(|q| q.active.as_ref()) {
                    start.item_id = active.item.id.clone();
                    start.plan = active.plan.iter().map(plan_surface).collect();
                }
            }
            Some(Payload::WakeFinish(finish)) => {
                if let Some(active) = self.state.queue(&finish.agent_id).and_then(|q| q.active.as_ref()) {
                    finish.item_id = active.item.id.clone();
                }
            }
            Some(Payload::WakeHeartbeat(heartbeat)) => {
                if let Some(active) = self.state.queue(&heartbeat.agent_id).and_then(|q| q.active.as_ref()) {
                    heartbeat.item_id = active.item.id.clone();
                }
            }
            Some(Payload::WakeRecovery(recovery)) => {
                if let Some(active) = self.state.queue(&recovery.agent_id).and_then(|q| q.active.as_ref()) {
                    recovery.item_id = active.item.id.clone();
                }
            }
            _ => {}
        }
        event
    }

    pub fn verdict(&self, seq: u64) -> &Verdict {
        self.state.verdict(seq).unwrap_or_else(|| panic!("no verdict recorded for seq {seq}"))
    }

    /// The body of the journal row written by the event at `seq`.
    pub fn body(&self, seq: u64) -> RowBody {
        let event = &self.events[usize::try_from(seq - 1).unwrap()];
        RowBody::from_envelope(event).unwrap_or_else(|| panic!("event {seq} has no body"))
    }

    /// The rows with their bodies, for rendering.
    pub fn with_bodies<'a>(&self, rows: &'a [RowMeta]) -> Vec<(&'a RowMeta, RowBody)> {
        rows.iter().map(|row| (row, self.body(row.seq))).collect()
    }

    /// Every cursor of `agent`, as `surface@N`.
    pub fn cursors(&self, agent: &str) -> String {
        let cursors: Vec<String> = self
            .state
            .cursor_entries()
            .into_iter()
            .filter(|((a, _), _)| *a == agent)
            .map(|((_, surface), n)| format!("{surface}@{n}"))
            .collect();
        if cursors.is_empty() {
            "none".to_owned()
        } else {
            cursors.join(", ")
        }
    }
}

/// The wire form of one plan entry, as a runtime hands it back.
pub fn plan_surface(entry: &PlanEntry) -> proto::PlanSurface {
    entry.to_plan_surface()
}

pub fn describe_cursor(cursor: Option<u64>) -> String {
    cursor.map_or_else(|| "-".to_owned(), |c| c.to_string())
}

pub fn describe_plan(plan: &[PlanEntry]) -> String {
    plan.iter()
        .map(|entry| {
            let expected = entry.expected.map_or_else(|| "absent".to_owned(), |c| format!("@{c}"));
            format!("{} {expected} -> @{}", entry.surface, entry.target)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

pub fn describe_refusal(refusal: &Refusal) -> String {
    format!("refused {:?}: {}", refusal.kind, refusal.message)
}
