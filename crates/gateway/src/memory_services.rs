//! `anima.v1.Memory`: the scheduler's dry run and one agent's memory-pass status, read from this
//! instance's projection ("Dreaming").

use anima_engine::clock::{Clock, SystemClock};
use anima_engine::Engine;
use anima_projections::memory::PassPlanEntry;
use anima_projections::memory_slot::MemoryPassCalendar;
use tonic::{Request, Response, Status};

use crate::api;
use crate::auth::Principal;

const NS_PER_MS: i64 = 1_000_000;

#[derive(Clone)]
pub struct MemoryService {
    engine: Engine,
}

impl MemoryService {
    pub fn new(engine: Engine) -> Self {
        MemoryService { engine }
    }
}

fn entry(entry: &PassPlanEntry) -> api::MemoryPlanEntry {
    let due = entry.due.as_ref();
    api::MemoryPlanEntry {
        agent_id: entry.agent.clone(),
        status: entry.status.as_str().to_owned(),
        why: entry.why.clone(),
        window_day: due.map(|d| d.local_date_label()).unwrap_or_default(),
        slot_at_ms: due.map_or(0, |d| d.slot_at_ns.div_euclid(NS_PER_MS)),
        slot_label: entry.due_label.clone(),
        pass_id: due.map(|d| d.pass_id.clone()).unwrap_or_default(),
        newest_history_seq: entry.gate.newest_history_seq,
        newest_outcome_seq: entry.gate.newest_outcome_seq,
    }
}

fn as_of_ns(as_of_ms: i64) -> Result<i64, Status> {
    match as_of_ms {
        0 => Ok(SystemClock.now_ns()),
        ms if ms < 0 => Err(Status::invalid_argument("as_of_ms: must be 0 (now) or a unix time in milliseconds")),
        ms => ms.checked_mul(NS_PER_MS).ok_or_else(|| Status::invalid_argument("as_of_ms: out of range")),
    }
}

#[tonic::async_trait]
impl api::memory_server::Memory for MemoryService {
    async fn plan(
        &self,
        request: Request<api::MemoryPlanRequest>,
    ) -> Result<Response<api::MemoryPlanResponse>, Status> {
        let as_of = as_of_ns(request.get_ref().as_of_ms)?;
        let plan = self.engine.memory_plan(as_of);
        Ok(Response::new(api::MemoryPlanResponse {
            as_of_ms: as_of.div_euclid(NS_PER_MS),
            enabled: plan.config.enabled,
            max_concurrent: plan.config.max_concurrent,
            open: plan.open,
            timezone: plan.config.settings.timezone.clone(),
            entries: plan.entries.iter().map(entry).collect(),
        }))
    }

    async fn status(
        &self,
        request: Request<api::MemoryStatusRequest>,
    ) -> Result<Response<api::MemoryStatusResponse>, Status> {
        let principal = Principal::of(&request)?;
        let agent = request.into_inner().agent_id;
        principal.require_agent(&agent)?;
        let now = SystemClock.now_ns();
        let (current, config) = {
            let state = self.engine.projection().state();
            (state.memory_status(&agent, now), state.memory_config())
        };
        let Some(current) = current else {
            return Err(Status::not_found(format!(
                "agent_id: {} is neither registered nor in the scope",
                anima_engine::validate::echo(&agent)
            )));
        };
        let next = MemoryPassCalendar::new(&config.settings).ok().and_then(|calendar| {
            let next = calendar.next_slot_at_ns(now, &agent)?;
            let label = calendar.local_label(next.slot);
            Some((next, label))
        });
        let last_outcome = current.gate.last_outcome.as_ref().map(|o| api::MemoryOutcomeStatus {
            pass_id: o.pass_id.clone(),
            window_day: o.window_day.clone(),
            outcome: o.outcome.as_str().to_owned(),
            slot_at_ms: o.slot_at_ns.div_euclid(NS_PER_MS),
            started_at_ms: o.started_at_ns.map_or(0, |s| s.div_euclid(NS_PER_MS)),
            delay_ms: o.delay_ns.map_or(0, |d| d.div_euclid(NS_PER_MS)),
            finished_at_ms: o.finished_at_ns.div_euclid(NS_PER_MS),
            finished_seq: o.finished_seq,
            reason: o.reason.clone(),
        });
        Ok(Response::new(api::MemoryStatusResponse {
            agent_id: agent.clone(),
            now: Some(entry(&current)),
            next_window_day: next.as_ref().map(|(n, _)| n.local_date_label()).unwrap_or_default(),
            next_slot_at_ms: next.as_ref().map_or(0, |(n, _)| n.slot_at_ns.div_euclid(NS_PER_MS)),
            next_slot_label: next.map(|(_, label)| label).unwrap_or_default(),
            last_outcome,
        }))
    }
}
