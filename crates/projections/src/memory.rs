//! The memory pass ("Dreaming") in the fold: the `memoryCoherence` configuration
//! as the log holds it, each agent's eligibility gate, pass requests judged at their place in the
//! log, outcomes classified from the runtime's digests, and the plan the scheduler and
//! `Memory.Plan` read.
//!
//! * **Gate**: per agent, the log seq of its newest history entry (a non-memory wake queued for
//!   it, a confirmed own send) and of its newest outcome. Eligible only when history is newer.
//! * **Request** (`MemoryPassRequested`, appended by any instance's scheduler): accepted when
//!   passes are enabled, the agent is registered and in scope, the window-day named is the one
//!   whose slot is due at the request's log time, no pass of that day or a later one was queued
//!   for the agent, the gate is open, and fewer than `maxConcurrent` passes are queued or running
//!   across the fleet. So the limit holds with any number of instances.
//! * **Outcome**: every finish of a pass records one, except a restart drain (which re-queues):
//!   completed with different digests → `completed`, with equal ones → `quiet_skipped`, failed or
//!   aborted → `failed` with the reason. Recording it closes the gate.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::memory_slot::{DueSlots, MemoryPassCalendar, MemoryPassSettings, MemoryPassSettingsError, MemoryPassSlot};
use crate::proto;
use crate::state::{LogPosition, State};
use crate::surface::SurfaceId;
use crate::verdict::refused;
use crate::verdict::{RefusalKind, Verdict};
use crate::wake::{WakeItem, WakeReason, QUEUED_ITEMS_MAX};

/// Largest `maxConcurrent`.
pub const MAX_CONCURRENT_MAX: u32 = 100;
/// Default `maxConcurrent`.
pub const MAX_CONCURRENT_DEFAULT: u32 = 1;
/// Default size of `MEMORY.md` above which a pass gets the consolidation form of its wake text.
pub const CONSOLIDATION_THRESHOLD_BYTES_DEFAULT: u64 = 20 * 1024;
/// Agents a scope may list.
pub const SCOPE_AGENTS_MAX: usize = 10_000;
/// Bytes of a failed pass's reason kept in its outcome record.
pub const OUTCOME_REASON_BYTES_MAX: usize = 1_000;
/// Bytes of a SHA-256 digest.
pub const DIGEST_BYTES: usize = 32;

/// The `memoryCoherence` configuration the fold decides by: the newest one in the log, or the
/// defaults when the log holds none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryConfig {
    pub enabled: bool,
    pub settings: MemoryPassSettings,
    pub max_concurrent: u32,
    /// Sorted, without duplicates; empty: every registered agent.
    pub scope_agent_ids: Vec<String>,
    pub consolidation_threshold_bytes: u64,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            enabled: true,
            settings: MemoryPassSettings::default(),
            max_concurrent: MAX_CONCURRENT_DEFAULT,
            scope_agent_ids: Vec::new(),
            consolidation_threshold_bytes: CONSOLIDATION_THRESHOLD_BYTES_DEFAULT,
        }
    }
}

/// A `memoryCoherence` value that cannot be used; the message names the key. Fix the
/// configuration: nothing here is worth a retry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MemoryConfigError {
    #[error(transparent)]
    Window(#[from] MemoryPassSettingsError),
    #[error("memoryCoherence.maxConcurrent: expected 1..={MAX_CONCURRENT_MAX}, got {0}")]
    MaxConcurrent(i64),
    #[error("memoryCoherence.scopeAgentIds: {0}")]
    Scope(String),
}

impl MemoryConfigError {
    /// The configuration key at fault, as spelled in the TOML.
    pub fn key(&self) -> &'static str {
        match self {
            MemoryConfigError::Window(e) => e.key(),
            MemoryConfigError::MaxConcurrent(_) => "maxConcurrent",
            MemoryConfigError::Scope(_) => "scopeAgentIds",
        }
    }
}

impl MemoryConfig {
    /// Checks and converts configured values (see [`MemoryPassSettings::parse`] for the window).
    pub fn new(
        enabled: bool,
        window_start: &str,
        window_duration_minutes: i64,
        max_concurrent: i64,
        timezone: &str,
        scope_agent_ids: &[String],
        consolidation_threshold_bytes: u64,
    ) -> Result<MemoryConfig, MemoryConfigError> {
        let settings = MemoryPassSettings::parse(window_start, window_duration_minutes, timezone)?;
        let max_concurrent = match u32::try_from(max_concurrent) {
            Ok(n) if (1..=MAX_CONCURRENT_MAX).contains(&n) => n,
            _ => return Err(MemoryConfigError::MaxConcurrent(max_concurrent)),
        };
        if scope_agent_ids.len() > SCOPE_AGENTS_MAX {
            return Err(MemoryConfigError::Scope(format!(
                "lists {} agents; at most {SCOPE_AGENTS_MAX}",
                scope_agent_ids.len()
            )));
        }
        if let Some(bad) = scope_agent_ids.iter().find(|id| id.is_empty() || id.len() > 256) {
            return Err(MemoryConfigError::Scope(format!(
                "agent ids are 1..=256 bytes; got one of {} bytes",
                bad.len()
            )));
        }
        let mut scope = scope_agent_ids.to_vec();
        scope.sort();
        scope.dedup();
        Ok(MemoryConfig { enabled, settings, max_concurrent, scope_agent_ids: scope, consolidation_threshold_bytes })
    }

    /// The configuration an event carries, checked like the TOML's.
    pub fn from_proto(event: &proto::MemoryCoherenceConfigured) -> Result<MemoryConfig, MemoryConfigError> {
        MemoryConfig::new(
            event.enabled,
            &event.window_start,
            i64::from(event.window_duration_minutes),
            i64::from(event.max_concurrent),
            &event.timezone,
            &event.scope_agent_ids,
            event.consolidation_threshold_bytes,
        )
    }

    pub fn to_proto(&self) -> proto::MemoryCoherenceConfigured {
        proto::MemoryCoherenceConfigured {
            enabled: self.enabled,
            window_start: self.settings.window_start_label(),
            window_duration_minutes: u32::from(self.settings.window_minutes),
            max_concurrent: self.max_concurrent,
            timezone: self.settings.timezone.clone(),
            scope_agent_ids: self.scope_agent_ids.clone(),
            consolidation_threshold_bytes: self.consolidation_threshold_bytes,
        }
    }

    pub fn in_scope(&self, agent: &str) -> bool {
        self.scope_agent_ids.is_empty() || self.scope_agent_ids.binary_search_by(|id| id.as_str().cmp(agent)).is_ok()
    }

    /// The zone resolved. The settings were validated when the configuration was built, so this
    /// fails only for a configuration built by hand.
    pub fn calendar(&self) -> Result<MemoryPassCalendar, MemoryPassSettingsError> {
        MemoryPassCalendar::new(&self.settings)
    }
}

/// One agent's memory-pass gate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryGate {
    /// Log seq of the newest history entry (0: none).
    pub newest_history_seq: u64,
    /// Log seq of the newest outcome (0: none).
    pub newest_outcome_seq: u64,
    /// The newest window-day a pass was queued for (`YYYY-MM-DD`; empty: none). A request for
    /// this day or an earlier one is not new.
    pub last_window_day: String,
    /// Shared, so a plan reads every agent's gate without copying its record (encoded as the
    /// record itself).
    pub last_outcome: Option<Arc<MemoryOutcomeRecord>>,
}

impl MemoryGate {
    /// History newer than the newest outcome.
    pub fn eligible(&self) -> bool {
        self.newest_history_seq > self.newest_outcome_seq
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemoryOutcome {
    /// The memory files changed.
    Completed,
    /// The pass ran and changed nothing.
    QuietSkipped,
    /// The turn failed or was aborted (not by a restart drain).
    Failed,
}

impl MemoryOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOutcome::Completed => "completed",
            MemoryOutcome::QuietSkipped => "quiet_skipped",
            MemoryOutcome::Failed => "failed",
        }
    }
}

/// `memory_coherence.outcome`: what became of one pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryOutcomeRecord {
    pub pass_id: String,
    pub window_day: String,
    /// When the pass was due (unix ns).
    pub slot_at_ns: i64,
    /// Log time of the accepted start (`None`: finished without starting).
    pub started_at_ns: Option<i64>,
    /// Start minus slot.
    pub delay_ns: Option<i64>,
    pub finished_seq: u64,
    pub finished_at_ns: i64,
    pub outcome: MemoryOutcome,
    /// For `failed`: the runtime's reason, clipped to [`OUTCOME_REASON_BYTES_MAX`].
    pub reason: String,
}

/// What a queued pass carries besides its id (`memory-pass:{agent}:{window_day}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryWake {
    pub window_day: String,
    pub slot_at_ns: i64,
    /// The slot in the configured zone, e.g. `2026-03-08 05:17 EST`.
    pub slot_label: String,
}

/// A pass queued or running, fleet-wide: what the limit counts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenPass {
    pub agent: String,
    pub window_day: String,
    pub slot_at_ns: i64,
    pub queued_seq: u64,
    /// Log time of the accepted start, once started.
    pub started_at_ns: Option<i64>,
}

/// Where an agent stands for its due pass, as a plan sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PassStatus {
    /// Memory passes are disabled by configuration.
    Disabled,
    /// The configuration's scope does not list the agent.
    OutOfScope,
    /// The scope lists an agent that is not registered.
    NotRegistered,
    /// Nothing happened for the agent since its last outcome (or ever).
    NoNewHistory,
    /// The due window-day's pass was already queued and has finished.
    AlreadyDone,
    /// The due window-day's pass is queued or running.
    Open,
    /// Due and eligible, but `maxConcurrent` passes are open or will be by the agents before it.
    WaitingForLimit,
    /// Due and eligible: the scheduler requests it now.
    Due,
}

impl PassStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PassStatus::Disabled => "disabled",
            PassStatus::OutOfScope => "out_of_scope",
            PassStatus::NotRegistered => "not_registered",
            PassStatus::NoNewHistory => "no_new_history",
            PassStatus::AlreadyDone => "already_done",
            PassStatus::Open => "open",
            PassStatus::WaitingForLimit => "waiting_for_limit",
            PassStatus::Due => "due",
        }
    }
}

/// One agent's line of a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PassPlanEntry {
    pub agent: String,
    /// The slot due at the plan's instant (`None` only at the ends of the time range).
    pub due: Option<MemoryPassSlot>,
    pub due_label: String,
    pub status: PassStatus,
    /// Why, in words, with the facts the status rests on.
    pub why: String,
    pub gate: MemoryGate,
}

impl PassPlanEntry {
    /// A due, eligible pass that a place under `maxConcurrent` is left for: it would be queued.
    fn admit(&mut self) {
        self.status = PassStatus::Due;
        self.why = format!("due since {} and history is newer than the last outcome", self.due_label);
    }
}

/// A dry run of the scheduler at an instant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    pub as_of_ns: i64,
    pub config: MemoryConfig,
    /// Passes queued or running now.
    pub open: u32,
    /// Every registered agent and every agent the scope lists, in slot order (then by id).
    pub entries: Vec<PassPlanEntry>,
}

impl MemoryPlan {
    /// The agents the scheduler requests a pass for, in slot order.
    pub fn due(&self) -> impl Iterator<Item = &PassPlanEntry> {
        self.entries.iter().filter(|e| e.status == PassStatus::Due)
    }
}

impl State {
    /// The configuration the fold decides by.
    pub fn memory_config(&self) -> MemoryConfig {
        self.memory_config.get(&()).cloned().unwrap_or_default()
    }

    /// Whether the log holds a configuration (else the defaults apply).
    pub fn memory_config_in_log(&self) -> bool {
        self.memory_config.contains_key(&())
    }

    pub fn memory_gate(&self, agent: &str) -> MemoryGate {
        self.memory_gates.get(agent).cloned().unwrap_or_default()
    }

    pub(crate) fn configure_memory(&mut self, event: &proto::MemoryCoherenceConfigured) -> Verdict {
        match MemoryConfig::from_proto(event) {
            Ok(config) => {
                self.memory_config.insert((), config);
                Verdict::Configured
            }
            Err(e) => refused(RefusalKind::InvalidArgument, e.to_string()),
        }
    }

    /// Records a history entry for the agent's gate.
    pub(crate) fn note_memory_history(&mut self, at: LogPosition, agent: &str) {
        self.memory_gates.entry_or_default_by(agent).newest_history_seq = at.seq;
    }

    /// The memory pass the agent's active (claimed or running) wake is, if it is one. A memory
    /// pass is sealed: it reads untrusted history, so it must not be a path from
    /// an injected instruction to a post; the agent's sends and Linear responses are refused
    /// meanwhile.
    pub(crate) fn active_memory_pass(&self, agent: &str) -> Option<&str> {
        let active = self.queue(agent)?.active.as_ref()?;
        active.item.memory.is_some().then_some(active.item.id.as_str())
    }

    pub(crate) fn request_memory_pass(&mut self, at: LogPosition, request: &proto::MemoryPassRequested) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let agent = request.agent_id.as_str();
        if !self.agents.contains_key(&request.agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        let config = self.memory_config();
        let calendar = match config.calendar() {
            Ok(calendar) => calendar,
            Err(e) => return refused(RefusalKind::FailedPrecondition, e.to_string()),
        };
        let Some(due) = calendar.due_slot_at_ns(at.at_ns, agent) else {
            return refused(RefusalKind::FailedPrecondition, "no slot is due at this log time");
        };
        let open = self.memory_open.len() as u32;
        let (status, why) = pass_status(&config, &self.agent_pass_facts(agent), &due.local_date_label());
        match status {
            PassStatus::Due | PassStatus::WaitingForLimit => {}
            _ => return refused(refusal_kind(status), why),
        }
        if request.window_day != due.local_date_label() {
            return refused(
                RefusalKind::Aborted,
                format!(
                    "the slot due at this log time is the one of {}, not of {:?}",
                    due.local_date_label(),
                    request.window_day
                ),
            );
        }
        if open >= config.max_concurrent {
            return refused(
                RefusalKind::Aborted,
                format!("{open} memory passes are queued or running; maxConcurrent is {}", config.max_concurrent),
            );
        }
        if self.queue(agent).is_some_and(|q| q.queued_len() >= QUEUED_ITEMS_MAX) {
            return refused(RefusalKind::Aborted, "the agent's wake queue is full");
        }
        let window_day = due.local_date_label();
        let item = WakeItem {
            id: due.pass_id.clone(),
            reason: WakeReason::Memory,
            trigger_surface: SurfaceId::Memory { agent: agent.into() },
            trigger: crate::journal::row_meta(
                at,
                0,
                &due.pass_id,
                crate::time::log_seconds(at.at_ns),
                "",
                "",
                None,
                crate::row::BodyRef::default(),
            ),
            reply_to: SurfaceId::Memory { agent: agent.into() },
            queued_seq: at.seq,
            queued_at_ns: at.at_ns,
            resume_after_restart: false,
            note: None,
            linear: None,
            extras: crate::text::ExtrasSizes::default(),
            memory: Some(MemoryWake {
                window_day: window_day.clone(),
                slot_at_ns: due.slot_at_ns,
                slot_label: calendar.local_label(due.slot),
            }),
        };
        self.queues.entry_or_default_by(agent).push_back(item);
        self.memory_gates.entry_or_default_by(agent).last_window_day = window_day.clone();
        self.memory_open.insert(
            due.pass_id.clone(),
            OpenPass {
                agent: agent.to_owned(),
                window_day: window_day.clone(),
                slot_at_ns: due.slot_at_ns,
                queued_seq: at.seq,
                started_at_ns: None,
            },
        );
        Verdict::MemoryPassQueued { agent: agent.to_owned(), pass_id: due.pass_id, window_day }
    }

    /// A pass's start was accepted: remember when, for its outcome's delay.
    pub(crate) fn note_memory_pass_started(&mut self, at: LogPosition, pass_id: &str) {
        if let Some(open) = self.memory_open.get_mut(pass_id) {
            open.started_at_ns.get_or_insert(at.at_ns);
        }
    }

    /// Records the outcome of a finished pass (not a restart drain) and closes its gate. The
    /// finish was checked for its digests before.
    pub(crate) fn record_memory_outcome(
        &mut self,
        at: LogPosition,
        agent: &str,
        item: &WakeItem,
        request: &proto::WakeFinishRequested,
    ) -> MemoryOutcomeRecord {
        let memory = item.memory.as_ref();
        let open = self.memory_open.remove(&item.id);
        let outcome = match proto::WakeOutcome::try_from(request.outcome) {
            Ok(proto::WakeOutcome::Completed) if request.memory_digest_before == request.memory_digest_after => {
                MemoryOutcome::QuietSkipped
            }
            Ok(proto::WakeOutcome::Completed) => MemoryOutcome::Completed,
            _ => MemoryOutcome::Failed,
        };
        let slot_at_ns = memory.map_or(0, |m| m.slot_at_ns);
        let started_at_ns = open.and_then(|o| o.started_at_ns);
        let record = MemoryOutcomeRecord {
            pass_id: item.id.clone(),
            window_day: memory.map(|m| m.window_day.clone()).unwrap_or_default(),
            slot_at_ns,
            started_at_ns,
            delay_ns: started_at_ns.map(|s| s.saturating_sub(slot_at_ns)),
            finished_seq: at.seq,
            finished_at_ns: at.at_ns,
            outcome,
            reason: if outcome == MemoryOutcome::Failed { clip(&request.reason) } else { String::new() },
        };
        let gate = self.memory_gates.entry_or_default_by(agent);
        gate.newest_outcome_seq = at.seq;
        gate.last_outcome = Some(Arc::new(record.clone()));
        record
    }

    /// The scheduler's view at `as_of_ns`: every registered or scoped agent, its due slot, and
    /// whether a pass would be accepted now and why. Pure: the same state and instant give the
    /// same plan on every instance.
    pub fn memory_plan(&self, as_of_ns: i64) -> MemoryPlan {
        self.memory_plan_facts().plan(as_of_ns)
    }

    /// What a plan is computed from, read from the state: the configuration, the open passes
    /// and each covered agent's facts. Cheap (a lookup and a clone per agent), so a caller
    /// holding the state's lock reads these and computes [`PlanFacts::plan`] — the time-zone
    /// math, the wording and the sort — after letting go of it.
    pub fn memory_plan_facts(&self) -> PlanFacts {
        let config = self.memory_config();
        let open_by_agent: BTreeMap<&str, &OpenPass> =
            self.memory_open.iter().map(|(_, open_pass)| (open_pass.agent.as_str(), open_pass)).collect();
        let facts_of = |agent: &str, registered: bool, gate: Option<&MemoryGate>| AgentPassFacts {
            agent: agent.to_owned(),
            registered,
            open_pass: open_by_agent.get(agent).map(|open_pass| (*open_pass).clone()),
            gate: gate.cloned().unwrap_or_default(),
        };
        let mut agents: Vec<AgentPassFacts> = Vec::with_capacity(self.agents.len());
        // Agents and gates are both ordered by id: one walk over the two pairs each agent with
        // its gate, no lookup per agent (this runs under the state's lock).
        let mut gates = self.memory_gates.iter().peekable();
        for (id, _) in self.agents.iter() {
            // Most agents have a gate: try equality first (one comparison, each a memory miss).
            let gate = loop {
                match gates.peek() {
                    Some((gate_agent, _)) if *gate_agent == id => break gates.next().map(|(_, gate)| gate),
                    Some((gate_agent, _)) if gate_agent.as_str() < id.as_str() => drop(gates.next()),
                    _ => break None,
                }
            };
            agents.push(facts_of(id, true, gate));
        }
        agents.extend(
            config
                .scope_agent_ids
                .iter()
                .filter(|id| !self.agents.contains_key(*id))
                .map(|id| facts_of(id, false, self.memory_gates.get(id))),
        );
        PlanFacts { open: self.memory_open.len() as u32, config, agents }
    }

    /// One agent's facts, as [`State::memory_plan_facts`] reads them.
    fn agent_pass_facts(&self, agent: &str) -> AgentPassFacts {
        AgentPassFacts {
            agent: agent.to_owned(),
            registered: self.agents.contains_key(agent),
            // One open pass per agent: `memory_open` holds at most maxConcurrent passes, so
            // the scan is short.
            open_pass: self.memory_open.iter().map(|(_, open_pass)| open_pass).find(|p| p.agent == agent).cloned(),
            gate: self.memory_gate(agent),
        }
    }

    /// One agent's line as of `as_of_ns`, without computing every agent's plan: a due, eligible
    /// pass is `Due` when the fold would accept a request for it now (fewer than `maxConcurrent`
    /// open), else `WaitingForLimit`. (The full plan also shares free places out in slot order.)
    /// `None` when the agent is neither registered nor in the scope.
    pub fn memory_status(&self, agent: &str, as_of_ns: i64) -> Option<PassPlanEntry> {
        let config = self.memory_config();
        let scoped = config.scope_agent_ids.binary_search_by(|id| id.as_str().cmp(agent)).is_ok();
        if !self.agents.contains_key(agent) && !scoped {
            return None;
        }
        let calendar = config.calendar().ok();
        let mut slots = calendar.as_ref().map(|c| c.due_slots(as_of_ns));
        let mut entry = plan_entry(&config, slots.as_mut(), self.agent_pass_facts(agent));
        if entry.status == PassStatus::WaitingForLimit {
            let open = self.memory_open.len() as u32;
            if open < config.max_concurrent {
                entry.admit();
            } else {
                entry.why = format!(
                    "due since {}, but {open} passes are open (maxConcurrent {})",
                    entry.due_label, config.max_concurrent
                );
            }
        }
        Some(entry)
    }
}

fn refusal_kind(status: PassStatus) -> RefusalKind {
    match status {
        PassStatus::NotRegistered => RefusalKind::InvalidArgument,
        PassStatus::Open | PassStatus::AlreadyDone => RefusalKind::Aborted,
        _ => RefusalKind::FailedPrecondition,
    }
}

fn clip(reason: &str) -> String {
    let mut end = reason.len().min(OUTCOME_REASON_BYTES_MAX);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_owned()
}

/// The status of an agent's due pass, before the limit is shared out: `WaitingForLimit`
/// stands for "due and eligible" and [`PlanFacts::plan`] turns the first ones into `Due`. The
/// fold's request judging and the plan both use it: one copy of the rule.
fn pass_status(config: &MemoryConfig, facts: &AgentPassFacts, day: &str) -> (PassStatus, String) {
    let agent = facts.agent.as_str();
    if !config.enabled {
        return (PassStatus::Disabled, "memory passes are disabled (memoryCoherence.enabled = false)".into());
    }
    if !config.in_scope(agent) {
        return (PassStatus::OutOfScope, "memoryCoherence.scopeAgentIds does not list this agent".into());
    }
    if !facts.registered {
        return (PassStatus::NotRegistered, "the scope lists this agent but it is not registered".into());
    }
    // One open pass per agent: with maxConcurrent ≥ 2 yesterday's pass, still queued or
    // running, must not let today's open beside it.
    if let Some(open_pass) = &facts.open_pass {
        let state = if open_pass.started_at_ns.is_some() { "running" } else { "queued" };
        return (
            PassStatus::Open,
            format!("the pass of {} is {state} (queued at seq {})", open_pass.window_day, open_pass.queued_seq),
        );
    }
    let gate = &facts.gate;
    if !gate.last_window_day.is_empty() && gate.last_window_day.as_str() >= day {
        let outcome = gate
            .last_outcome
            .as_ref()
            .map_or("no outcome yet".to_owned(), |o| format!("{} at seq {}", o.outcome.as_str(), o.finished_seq));
        return (PassStatus::AlreadyDone, format!("the pass of {} already ran ({outcome})", gate.last_window_day));
    }
    if !gate.eligible() {
        let why = match (gate.newest_history_seq, gate.newest_outcome_seq) {
            (0, _) => "no history: no wake was queued and no send confirmed for this agent".to_owned(),
            (history, outcome) => {
                format!(
                    "no new history: the newest entry (seq {history}) is older than the last outcome (seq {outcome})"
                )
            }
        };
        return (PassStatus::NoNewHistory, why);
    }
    (PassStatus::WaitingForLimit, String::new())
}

/// One agent's line of the plan, before the limit is shared out (see [`pass_status`]), with
/// its slot from the slots due at the plan's instant.
fn plan_entry(config: &MemoryConfig, slots: Option<&mut DueSlots<'_>>, facts: AgentPassFacts) -> PassPlanEntry {
    let Some((due, day, label)) = slots.and_then(|slots| slots.of(&facts.agent)) else {
        let why = "no slot is representable at this instant".to_owned();
        return PassPlanEntry {
            agent: facts.agent,
            due: None,
            due_label: String::new(),
            status: PassStatus::Disabled,
            why,
            gate: facts.gate,
        };
    };
    let (status, why) = pass_status(config, &facts, day);
    PassPlanEntry { agent: facts.agent, due: Some(due), due_label: label.to_owned(), status, why, gate: facts.gate }
}

/// One agent as a plan judges it: the facts [`pass_status`] reads.
#[derive(Clone, Debug)]
pub struct AgentPassFacts {
    pub agent: String,
    pub registered: bool,
    /// Its pass still queued or running, if one is.
    pub open_pass: Option<OpenPass>,
    pub gate: MemoryGate,
}

/// What a plan is computed from ([`State::memory_plan_facts`]).
#[derive(Clone, Debug)]
pub struct PlanFacts {
    pub config: MemoryConfig,
    /// Passes queued or running, fleet-wide.
    pub open: u32,
    pub agents: Vec<AgentPassFacts>,
}

impl PlanFacts {
    /// The plan at `as_of_ns`: slots, statuses and the limit shared out in slot order.
    pub fn plan(self, as_of_ns: i64) -> MemoryPlan {
        let PlanFacts { config, open, mut agents } = self;
        // Slot order, then id order: with the agents in id order (as the state reads them) a
        // sort of (slot, position) pairs gives it without comparing ids or moving entries.
        if !agents.is_sorted_by(|a, b| a.agent <= b.agent) {
            agents.sort_by(|a, b| a.agent.cmp(&b.agent));
        }
        let calendar = config.calendar().ok();
        let mut slots = calendar.as_ref().map(|c| c.due_slots(as_of_ns));
        let mut entries: Vec<Option<PassPlanEntry>> =
            agents.into_iter().map(|facts| Some(plan_entry(&config, slots.as_mut(), facts))).collect();
        let mut order: Vec<(i64, usize)> = entries
            .iter()
            .enumerate()
            .map(|(at, e)| (e.as_ref().and_then(|e| e.due.as_ref()).map_or(i64::MAX, |d| d.slot_at_ns), at))
            .collect();
        order.sort_unstable();
        let mut entries: Vec<PassPlanEntry> = order.into_iter().filter_map(|(_, at)| entries[at].take()).collect();
        // The limit, in slot order: the first free places go to the earliest slots.
        let mut free = config.max_concurrent.saturating_sub(open);
        // The agents left waiting share one sentence per slot, and slot order keeps them together.
        let mut waiting: Option<(String, String)> = None;
        for entry in entries.iter_mut().filter(|e| e.status == PassStatus::WaitingForLimit) {
            if free > 0 {
                free -= 1;
                entry.admit();
                continue;
            }
            let why = match &waiting {
                Some((label, why)) if *label == entry.due_label => why.clone(),
                _ => {
                    let why = format!(
                        "due since {}, but {open} passes are open and earlier slots take the rest of maxConcurrent {}",
                        entry.due_label, config.max_concurrent
                    );
                    waiting = Some((entry.due_label.clone(), why.clone()));
                    why
                }
            };
            entry.why = why;
        }
        MemoryPlan { as_of_ns, config, open, entries }
    }
}
