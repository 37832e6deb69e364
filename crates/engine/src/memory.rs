//! The memory-pass side of the engine: the `memoryCoherence` configuration
//! appended to the log when it differs from what the log holds, and the scheduler loop.
//!
//! Every instance may run the loop. Each tick reads the plan from its own projection
//! ([`anima_projections::State::memory_plan`]) at its clock's "now" and requests a pass for each
//! agent the plan calls due, in slot order; the fold judges every request at its place in the log
//! (due by log time, new, eligible, under `maxConcurrent`), so the limit holds with any number of
//! instances and refusals happen only when two instances race.

use std::sync::Arc;
use std::time::Duration;

use anima_projections::memory::{MemoryConfig, MemoryPlan};
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::verdict::Verdict;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::clock::Clock;
use crate::command::{CommandError, Engine, EVENT_ID_NAMESPACE};

/// Default scheduler tick.
pub const TICK_DEFAULT: Duration = Duration::from_secs(30);

/// What one scheduler tick did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TickReport {
    /// Pass ids the fold queued.
    pub queued: Vec<String>,
    /// Requests the fold refused (another instance got there first, or the limit filled).
    pub refused: usize,
}

impl Engine {
    /// Appends `config` to the log when the configuration the fold decides by differs (or when
    /// the log holds none yet, so replay sees what decisions were made under). Returns whether
    /// it appended. Instances starting with one file dedupe on the event id.
    pub async fn sync_memory_config(&self, config: &MemoryConfig) -> Result<bool, CommandError> {
        let (in_log, current) = {
            let state = self.projection().state();
            (state.memory_config_in_log(), state.memory_config())
        };
        if in_log && &current == config {
            return Ok(false);
        }
        let event = config.to_proto();
        let replaced = if in_log { prost::Message::encode_to_vec(&current.to_proto()) } else { Vec::new() };
        let encoded = prost::Message::encode_to_vec(&event);
        self.append_config("memory-config", &encoded, &replaced, Payload::MemoryConfig(event)).await?;
        Ok(true)
    }

    /// Appends a configuration event on the config subject. The id names the configuration and
    /// the one it replaces: instances starting together with one file dedupe, and going back to
    /// an earlier configuration (A, B, A) within the log's dedupe window is still appended.
    pub(crate) async fn append_config(
        &self,
        name: &str,
        encoded: &[u8],
        replaced: &[u8],
        payload: Payload,
    ) -> Result<(), CommandError> {
        let event_id = Uuid::new_v5(&EVENT_ID_NAMESPACE, &[name.as_bytes(), b"\0", encoded, b"\0", replaced].concat());
        let envelope = self.envelope(event_id.to_string(), 0, payload);
        self.append_and_decide(self.subjects().config(), &envelope).await?;
        Ok(())
    }

    /// Appends the do-not-contact lists when they differ from the log's (an empty
    /// configuration is not appended to a log that never had one). Returns whether it appended.
    pub async fn sync_do_not_contact(
        &self,
        config: &anima_projections::do_not_contact::DoNotContact,
    ) -> Result<bool, CommandError> {
        let current = self.projection().state().do_not_contact_config().cloned();
        match &current {
            Some(current) if current == config => return Ok(false),
            None if config.lists.is_empty() => return Ok(false),
            _ => {}
        }
        let event = config.to_proto();
        let replaced = current.map(|c| prost::Message::encode_to_vec(&c.to_proto())).unwrap_or_default();
        let encoded = prost::Message::encode_to_vec(&event);
        self.append_config("do-not-contact", &encoded, &replaced, Payload::DoNotContact(event)).await?;
        Ok(true)
    }

    /// The scheduler's dry run at `as_of_ns` from this instance's state.
    ///
    /// Only the facts are read under the state's lock (which requests and the fold need); the
    /// slots, the wording and the sort are computed after it is let go.
    pub fn memory_plan(&self, as_of_ns: i64) -> MemoryPlan {
        let facts = self.projection().state().memory_plan_facts();
        facts.plan(as_of_ns)
    }

    /// Asks the fold to queue the agent's pass of `window_day`.
    pub async fn request_memory_pass(
        &self,
        agent: &str,
        window_day: &str,
        slot_at_ns: i64,
    ) -> Result<String, CommandError> {
        self.require_agent("agent_id", agent)?;
        let request = proto::MemoryPassRequested {
            agent_id: agent.to_owned(),
            window_day: window_day.to_owned(),
            slot_at_ms: slot_at_ns.div_euclid(1_000_000),
        };
        // A fresh id per request: a refused request (the limit was full) must not shadow a later
        // one in the log's dedupe window.
        let envelope = self.envelope(Uuid::now_v7().to_string(), 0, Payload::MemoryPass(request));
        let (_, verdict) = self.append_and_decide(self.subjects().agent(agent), &envelope).await?;
        match verdict {
            Verdict::MemoryPassQueued { pass_id, .. } => Ok(pass_id),
            other => Err(crate::command::unexpected(other)),
        }
    }

    /// One scheduler tick at `now_ns`: requests every pass the plan calls due, in slot order.
    pub async fn memory_tick(&self, now_ns: i64) -> Result<TickReport, CommandError> {
        let plan = self.memory_plan(now_ns);
        let mut report = TickReport::default();
        for entry in plan.due() {
            let Some(due) = &entry.due else { continue };
            match self.request_memory_pass(&entry.agent, &due.local_date_label(), due.slot_at_ns).await {
                Ok(pass_id) => {
                    tracing::info!(agent = %entry.agent, pass = %pass_id, slot = %entry.due_label, "memory pass queued");
                    report.queued.push(pass_id);
                }
                Err(CommandError::Refused(refusal)) => {
                    tracing::debug!(agent = %entry.agent, reason = %refusal.message, "memory pass refused");
                    report.refused += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(report)
    }
}

/// Runs [`Engine::memory_tick`] every `interval` with `clock`'s time until `shutdown`.
pub async fn run_memory_scheduler(
    engine: Engine,
    clock: Arc<dyn Clock>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    crate::clock::every(interval, &shutdown, || async {
        if let Err(e) = engine.memory_tick(clock.now_ns()).await {
            tracing::warn!(error = %e, "memory-pass scheduler");
        }
    })
    .await;
}
