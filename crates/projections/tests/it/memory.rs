//! Memory passes ("Dreaming") as an operator and an agent notice them: one pass per
//! agent and local window-day through DST changes, `maxConcurrent` with any number of engine
//! instances, outcomes from the runtime's digests, a plan that says why, requests judged by log
//! time, and the wake text of a pass.
//!
//! Every event is stamped with an explicit log time (`Fleet::at`) or one second after the one
//! before (`Fleet::then`), so a test reads as a day on a clock: history, the scheduler's tick,
//! the runtime's claim, start and finish.
//!
//! Slots in a 120-minute window (the agents' offsets, from SHA-256 of their ids): zed +0,
//! idle +8, bo +47, ivy +74, ghost +75, oz +84, fay +113 minutes. With the default window
//! (05:00 UTC) zed is due at 05:00, bo at 05:47, ivy at 06:14 and fay at 06:53.

use std::fmt::Write;

use anima_projections::journal::RowBody;
use anima_projections::memory::{MemoryConfig, MemoryOutcome, MemoryOutcomeRecord, MemoryPlan, MemoryWake, PassStatus};
use anima_projections::memory_slot::MemoryPassCalendar;
use anima_projections::proto::{self, envelope::Payload, Envelope, WakeOutcome};
use anima_projections::render;
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::{ClaimVerdict, ClaimedWake, RefusalKind, Verdict};
use expect_test::{expect, Expect};
use jiff::civil::{date, Date};
use jiff::{SignedDuration, Timestamp};

use crate::events::*;
use crate::log::{describe_refusal, TestLog};

// ---------------------------------------------------------------------------------------------
// Vocabulary.

fn event(event_id: String, payload: Payload) -> Envelope {
    Envelope { event_id, occurred_at_ms: 0, min_reader_version: 1, source: "test".to_owned(), payload: Some(payload) }
}

/// An agent with Slack identities derived from its id.
fn registered(agent_id: &str) -> Envelope {
    let upper = agent_id.to_uppercase();
    agent(agent_id, &format!("U{upper}"), &format!("B{upper}"))
}

/// A valid `memoryCoherence` configuration: enabled, a 120-minute window, every agent, 20 KiB.
fn memory_config(zone: &str, window_start: &str, max_concurrent: u32) -> proto::MemoryCoherenceConfigured {
    proto::MemoryCoherenceConfigured {
        enabled: true,
        window_start: window_start.to_owned(),
        window_duration_minutes: 120,
        max_concurrent,
        timezone: zone.to_owned(),
        scope_agent_ids: Vec::new(),
        consolidation_threshold_bytes: 20 * 1024,
    }
}

fn configured(config: proto::MemoryCoherenceConfigured) -> Envelope {
    event("memory-config".to_owned(), Payload::MemoryConfig(config))
}

/// A scheduler asks for the agent's pass of a window-day.
fn pass_request(agent_id: &str, window_day: &str) -> Envelope {
    event(
        format!("memory-pass-request:{agent_id}:{window_day}"),
        Payload::MemoryPass(proto::MemoryPassRequested {
            agent_id: agent_id.to_owned(),
            window_day: window_day.to_owned(),
            slot_at_ms: 0,
        }),
    )
}

/// A claim that reports the size of the agent's `MEMORY.md`.
fn claim_with_memory_md(agent_id: &str, worker: &str, memory_md_bytes: u64) -> Envelope {
    let mut claim = claim(agent_id, worker);
    match claim.payload.as_mut() {
        Some(Payload::WakeClaim(c)) => c.memory_md_bytes = memory_md_bytes,
        other => panic!("not a claim: {other:?}"),
    }
    claim
}

/// The runtime finishes the agent's active wake with the digests of `MEMORY.md` + `notes/`.
fn finish_pass(
    agent_id: &str,
    worker: &str,
    outcome: WakeOutcome,
    before: &[u8],
    after: &[u8],
    reason: &str,
) -> Envelope {
    let mut finish = finish(agent_id, worker, outcome);
    match finish.payload.as_mut() {
        Some(Payload::WakeFinish(f)) => {
            f.memory_digest_before = before.to_vec();
            f.memory_digest_after = after.to_vec();
            f.reason = reason.to_owned();
        }
        other => panic!("not a finish: {other:?}"),
    }
    finish
}

/// A SHA-256-sized digest (the fold only compares them).
fn digest(seed: u8) -> [u8; 32] {
    [seed; 32]
}

fn instant(text: &str) -> Timestamp {
    text.parse().unwrap_or_else(|e| panic!("{text:?} is not an instant: {e}"))
}

fn ns(at: Timestamp) -> i64 {
    i64::try_from(at.as_nanosecond()).expect("in the log's range")
}

fn from_ns(at_ns: i64) -> Timestamp {
    Timestamp::from_nanosecond(i128::from(at_ns)).expect("a log time")
}

// ---------------------------------------------------------------------------------------------
// A fleet on a log with a clock.

struct Fleet {
    log: TestLog,
    /// Own posts made so far, for unique Slack ts.
    posts: u64,
}

impl Fleet {
    /// Registers `agents` at `start`; nothing else is in the log (so the defaults apply: UTC,
    /// 05:00, 120 minutes, maxConcurrent 1).
    fn new(start: &str, agents: &[&str]) -> Fleet {
        let mut fleet = Fleet { log: TestLog::new(), posts: 0 };
        for agent_id in agents {
            fleet.at(start, registered(agent_id));
        }
        fleet
    }

    /// Folds `event` at `at` (or just after the previous event, if that is later).
    fn at(&mut self, at: &str, event: Envelope) -> u64 {
        self.fold_at(instant(at), event)
    }

    fn fold_at(&mut self, at: Timestamp, mut event: Envelope) -> u64 {
        event.occurred_at_ms = at.as_millisecond();
        self.log.fold(event)
    }

    /// Folds `event` one second after the previous one.
    fn then(&mut self, event: Envelope) -> u64 {
        self.log.fold(event)
    }

    /// The agent's post, confirmed: a history entry, one second after the previous event.
    fn post(&mut self, agent_id: &str) -> u64 {
        let post = self.own_post(agent_id);
        self.then(post)
    }

    /// The agent's post, confirmed at `at`.
    fn post_at(&mut self, at: &str, agent_id: &str) -> u64 {
        let post = self.own_post(agent_id);
        self.at(at, post)
    }

    fn own_post(&mut self, agent_id: &str) -> Envelope {
        self.posts += 1;
        confirmed(agent_id, &format!("C{}", agent_id.to_uppercase()), &ts(self.posts), "done")
    }

    /// Claims, starts and finishes the agent's oldest wake, one second apart: a pass that changed
    /// the memory files.
    fn run_pass(&mut self, agent_id: &str) -> u64 {
        let claim = self.then(claim(agent_id, "w1"));
        assert!(matches!(self.verdict(claim), Verdict::Claim(ClaimVerdict::Claimed(_))), "{:?}", self.verdict(claim));
        let start = self.then(start(agent_id, "w1"));
        assert!(matches!(self.verdict(start), Verdict::Started { .. }), "{:?}", self.verdict(start));
        self.then(finish_pass(agent_id, "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""))
    }

    /// Claims, starts and finishes the agent's oldest wake (not a pass).
    fn run_conversation_wake(&mut self, agent_id: &str) {
        self.then(claim(agent_id, "w0"));
        self.then(start(agent_id, "w0"));
        let seq = self.then(finish(agent_id, "w0", WakeOutcome::Completed));
        assert!(matches!(self.verdict(seq), Verdict::Finished { .. }), "{}", self.describe(seq));
    }

    fn verdict(&self, seq: u64) -> &Verdict {
        self.log.verdict(seq)
    }

    fn describe(&self, seq: u64) -> String {
        describe(self.verdict(seq))
    }

    fn plan(&self, at: &str) -> MemoryPlan {
        self.log.state.memory_plan(ns(instant(at)))
    }

    fn open_passes(&self) -> usize {
        self.log.state.memory_open.len()
    }

    /// The agent's queue and active wake, one line each.
    fn describe_queue(&self, agent_id: &str) -> String {
        let queue = self.log.state.queue(agent_id);
        let queued: Vec<String> = queue
            .map(|q| {
                q.queued()
                    .map(|i| {
                        format!("{} {}{}", i.id, i.reason.as_str(), if i.resume_after_restart { " resume" } else { "" })
                    })
                    .collect()
            })
            .unwrap_or_default();
        let active = queue.and_then(|q| q.active.as_ref()).map_or_else(
            || "none".to_owned(),
            |a| format!("{} {}", a.item.id, if a.started_seq.is_some() { "running" } else { "claimed" }),
        );
        format!("queued: {}\nactive: {active}\n", if queued.is_empty() { "-".to_owned() } else { queued.join(", ") })
    }

    /// The agent's last outcome record.
    fn describe_outcome(&self, agent_id: &str) -> String {
        match &self.log.state.memory_gate(agent_id).last_outcome {
            None => "outcome: none\n".to_owned(),
            Some(record) => describe_outcome(record),
        }
    }
}

fn describe(verdict: &Verdict) -> String {
    match verdict {
        Verdict::MemoryPassQueued { pass_id, .. } => format!("queued {pass_id}"),
        Verdict::Claim(ClaimVerdict::Claimed(claimed)) => format!("claimed {}", claimed.item.id),
        Verdict::Claim(ClaimVerdict::Nothing { .. }) => "nothing to claim".to_owned(),
        Verdict::Started { item_id, coalesced, .. } if coalesced.is_empty() => format!("started {item_id}"),
        Verdict::Started { item_id, coalesced, .. } => {
            format!("started {item_id}; settled without a turn: {}", coalesced.join(", "))
        }
        Verdict::Finished { item_id, requeued, memory_outcome, .. } => format!(
            "finished {item_id}{}{}",
            if *requeued { ", re-queued" } else { "" },
            memory_outcome.as_ref().map(|o| format!(" ({})", o.outcome.as_str())).unwrap_or_default()
        ),
        Verdict::Configured => "configured".to_owned(),
        Verdict::Journaled(journaled) => format!("journaled #{}", journaled.ordinal),
        Verdict::Refused(refusal) => describe_refusal(refusal),
        other => format!("{other:?}"),
    }
}

fn describe_outcome(record: &MemoryOutcomeRecord) -> String {
    format!(
        "outcome: {} of {} (slot {}, started {}, delay {}, finished {}), reason: {}\n",
        record.outcome.as_str(),
        record.window_day,
        from_ns(record.slot_at_ns),
        record.started_at_ns.map_or_else(|| "-".to_owned(), |s| from_ns(s).to_string()),
        record.delay_ns.map_or_else(|| "-".to_owned(), |d| SignedDuration::from_nanos(d).to_string()),
        from_ns(record.finished_at_ns),
        if record.reason.is_empty() { "-" } else { &record.reason },
    )
}

/// One line per agent in slot order: status, the slot due and why.
fn describe_plan(plan: &MemoryPlan) -> String {
    let mut out = format!("open passes: {}\n", plan.open);
    for entry in &plan.entries {
        writeln!(out, "{} {} [{}]: {}", entry.agent, entry.status.as_str(), entry.due_label, entry.why).unwrap();
    }
    out
}

fn status_of(plan: &MemoryPlan, agent_id: &str) -> PassStatus {
    plan.entries.iter().find(|e| e.agent == agent_id).unwrap_or_else(|| panic!("{agent_id} is not planned")).status
}

// ---------------------------------------------------------------------------------------------
// 1. A simulated fleet across DST changes: one pass per agent and local window-day.

#[derive(Clone, Copy, Debug)]
enum History {
    /// A human's DM: a `dm` wake the runtime runs.
    Dm,
    /// A confirmed own post.
    Post,
}

/// The agents that have history every local day, and when (local time): twice a day, so that
/// there is always history newer than the last outcome when the next slot comes. In a window that
/// opens at 01:00 for 120 minutes their slots are zed 01:00, bo 01:47, ivy 02:14 and fay 02:53: in
/// New York's spring gap (02:00-03:00) for ivy and fay, in its autumn overlap (01:00-02:00) for
/// zed and bo; in London's gap and overlap (01:00-02:00) for zed and bo; in Lord Howe's overlap
/// (01:30-02:00) for bo and its gap (02:00-02:30) for ivy. The first history of the first day
/// comes after the day's slot, so that day's pass is a same-day catch-up; every later pass runs
/// in the window. (An agent with a single burst of history a day behaves differently, see
/// `one_burst_of_history_a_day_runs_each_pass_right_after_it_not_in_the_window`.)
const SIMULATED: [SimulatedAgent; 4] = [
    SimulatedAgent { id: "zed", history: History::Dm, local_times: [(9, 0), (18, 0)] },
    SimulatedAgent { id: "bo", history: History::Post, local_times: [(12, 0), (23, 30)] },
    SimulatedAgent { id: "fay", history: History::Dm, local_times: [(14, 0), (22, 0)] },
    SimulatedAgent { id: "ivy", history: History::Post, local_times: [(20, 0), (23, 0)] },
];

struct SimulatedAgent {
    id: &'static str,
    history: History,
    /// (hour, minute) of each history entry, every local day.
    local_times: [(i8, i8); 2],
}
/// A pass of a later day is queued this long after its slot at most: under maxConcurrent 1 up to
/// three passes of earlier slots run before it, each holding the limit until the first tick
/// after its 40 minutes (an hour).
const SLOT_DELAY_MAX_MINUTES: i64 = 180;
/// Registered, in scope, and never anything to remember.
const IDLE: &str = "idle";
/// The scheduler ticks every 30 minutes of log time (every third step).
const STEP_MINUTES: i64 = 10;
const TICK_STEPS: u64 = 3;
/// The runtime picks up a queued wake this long after the step began...
const RUNTIME_DELAY_MINUTES: i64 = 2;
/// ...and a pass takes this long, so an open pass spans the next scheduler tick.
const PASS_MINUTES: i64 = 40;
const SIMULATED_MAX_CONCURRENT: u32 = 1;

struct Simulation {
    log: TestLog,
    calendar: MemoryPassCalendar,
    /// Every pass the fold queued, in log order: (agent, pass id, what the pass carries,
    /// log time it was queued).
    queued: Vec<(String, String, MemoryWake, i64)>,
    /// Every outcome recorded, in log order.
    outcomes: Vec<MemoryOutcomeRecord>,
    /// Most passes open at once.
    open_max: usize,
    posts: u64,
}

impl Simulation {
    fn fold(&mut self, at: Timestamp, mut event: Envelope) -> u64 {
        event.occurred_at_ms = at.as_millisecond();
        let seq = self.log.fold(event);
        self.open_max = self.open_max.max(self.log.state.memory_open.len());
        seq
    }

    fn history(&mut self, at: Timestamp, agent_id: &str, kind: History) {
        self.posts += 1;
        let event = match kind {
            History::Dm => dm_from_human(agent_id, &format!("D{}", agent_id.to_uppercase()), &ts(self.posts), "hi"),
            History::Post => confirmed(agent_id, &format!("C{}", agent_id.to_uppercase()), &ts(self.posts), "done"),
        };
        let seq = self.fold(at, event);
        assert!(matches!(self.log.verdict(seq), Verdict::Journaled(j) if j.ordinal > 0), "{:?}", self.log.verdict(seq));
    }

    /// The engine's scheduler loop: a request for every due entry of the plan at `now`.
    fn scheduler_tick(&mut self, now: Timestamp) {
        let plan = self.log.state.memory_plan(ns(now));
        let due: Vec<_> = plan
            .due()
            .map(|e| {
                let slot = e.due.as_ref().expect("a due entry has a slot");
                (e.agent.clone(), slot.local_date_label(), slot.slot_at_ns / 1_000_000)
            })
            .collect();
        for (agent_id, window_day, slot_at_ms) in due {
            let mut request = pass_request(&agent_id, &window_day);
            if let Some(Payload::MemoryPass(r)) = request.payload.as_mut() {
                r.slot_at_ms = slot_at_ms;
            }
            let seq = self.fold(now, request);
            match self.log.verdict(seq) {
                Verdict::MemoryPassQueued { pass_id, .. } => {
                    let pass_id = pass_id.clone();
                    let item = self.log.state.queue(&agent_id).and_then(|q| q.queued().next_back()).expect("queued");
                    assert_eq!(item.id, pass_id);
                    let memory = item.memory.clone().expect("a pass carries its slot");
                    self.queued.push((agent_id, pass_id, memory, item.queued_at_ns));
                }
                other => panic!(
                    "at {now} the plan called {agent_id}'s pass of {window_day} due, but the fold said {other:?}"
                ),
            }
        }
    }

    /// The agent runtime: finishes passes that ran long enough (memory changed), then claims
    /// and starts what is queued; a DM wake is finished right away.
    fn runtime_step(&mut self, now: Timestamp, agents: &[&str]) {
        for &agent_id in agents {
            let active = self.log.state.queue(agent_id).and_then(|q| q.active.clone());
            if let Some(active) = active {
                let started = from_ns(active.last_alive_ns);
                if active.item.memory.is_none() || now - started < SignedDuration::from_mins(PASS_MINUTES) {
                    continue;
                }
                let seq =
                    self.fold(now, finish_pass(agent_id, "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""));
                match self.log.verdict(seq) {
                    Verdict::Finished { memory_outcome: Some(record), requeued: false, .. } => {
                        self.outcomes.push(*record.clone());
                    }
                    other => panic!("finish of {} at {now}: {other:?}", active.item.id),
                }
            }
            while self.log.state.queue(agent_id).is_some_and(|q| q.active.is_none() && !q.nothing_queued()) {
                let seq = self.fold(now, claim(agent_id, "w1"));
                let Verdict::Claim(ClaimVerdict::Claimed(claimed)) = self.log.verdict(seq) else {
                    panic!("claim for {agent_id} at {now}: {:?}", self.log.verdict(seq));
                };
                let is_pass = claimed.item.memory.is_some();
                let seq = self.fold(now, start(agent_id, "w1"));
                assert!(matches!(self.log.verdict(seq), Verdict::Started { .. }), "{:?}", self.log.verdict(seq));
                if is_pass {
                    break;
                }
                self.fold(now, finish(agent_id, "w1", WakeOutcome::Completed));
            }
        }
    }
}

/// Runs the fleet for `days` local days from `first_day` 00:00 in `zone`, with a window that
/// opens at 01:00 for 120 minutes and maxConcurrent 1.
fn simulate(zone: &str, first_day: Date, days: i16) -> Simulation {
    let config = memory_config(zone, "01:00", SIMULATED_MAX_CONCURRENT);
    let calendar = MemoryPassCalendar::new(&MemoryConfig::from_proto(&config).unwrap().settings).unwrap();
    let tz = calendar.time_zone().clone();
    let local =
        |day: Date, hour: i8, minute: i8| day.at(hour, minute, 0, 0).to_zoned_datetime(tz.clone()).unwrap().timestamp();
    let days_after = |n: i16| first_day.checked_add(jiff::Span::new().days(n)).unwrap();
    let start = local(first_day, 0, 0);
    let end = local(days_after(days), 0, 0);
    let mut history: Vec<(Timestamp, &str, History)> = Vec::new();
    for n in 0..days {
        for agent in SIMULATED {
            for (hour, minute) in agent.local_times {
                history.push((local(days_after(n), hour, minute), agent.id, agent.history));
            }
        }
    }
    history.sort_by_key(|(at, agent_id, _)| (*at, *agent_id));
    let mut agents: Vec<&str> = SIMULATED.iter().map(|agent| agent.id).collect();
    agents.push(IDLE);

    let mut sim =
        Simulation { log: TestLog::new(), calendar, queued: Vec::new(), outcomes: Vec::new(), open_max: 0, posts: 0 };
    let seq = sim.fold(start, configured(config));
    assert_eq!(sim.log.verdict(seq), &Verdict::Configured);
    for agent_id in &agents {
        sim.fold(start, registered(agent_id));
    }
    let mut history = history.into_iter().peekable();
    let mut now = start;
    let mut step = 0u64;
    while now < end {
        while let Some((at, agent_id, kind)) = history.next_if(|(at, ..)| *at <= now) {
            sim.history(at, agent_id, kind);
        }
        if step.is_multiple_of(TICK_STEPS) {
            sim.scheduler_tick(now);
        }
        sim.runtime_step(now + SignedDuration::from_mins(RUNTIME_DELAY_MINUTES), &agents);
        now += SignedDuration::from_mins(STEP_MINUTES);
        step += 1;
    }
    sim
}

/// Simulates `days` local days from `first_day`, checks that every agent with daily history got
/// exactly one pass per window-day (no day missing, none twice, each at its own slot, each with
/// one outcome), that the idle agent got nothing, and that the limit held; then compares the
/// slots of `transition_day` (local labels, which show the DST handling) with `expect`.
#[track_caller]
fn check_simulation(zone: &str, first_day: Date, days: i16, transition_day: Date, expect: Expect) {
    let sim = simulate(zone, first_day, days);
    let window_days: Vec<Date> = (0..days).map(|n| first_day.checked_add(jiff::Span::new().days(n)).unwrap()).collect();
    assert!(window_days.contains(&transition_day));

    for SimulatedAgent { id: agent_id, .. } in SIMULATED {
        let expected: Vec<String> = window_days.iter().map(|day| format!("memory-pass:{agent_id}:{day}")).collect();
        let actual: Vec<String> =
            sim.queued.iter().filter(|(a, ..)| a == agent_id).map(|(_, pass_id, ..)| pass_id.clone()).collect();
        assert_eq!(actual, expected, "{zone}: {agent_id}'s passes, one per local window-day in day order");
        for (day, (_, pass_id, memory, queued_at_ns)) in
            window_days.iter().zip(sim.queued.iter().filter(|(a, ..)| a == agent_id))
        {
            let slot = sim.calendar.slot_on(*day, agent_id).unwrap();
            assert_eq!(memory.slot_at_ns, ns(slot), "{zone}: {pass_id} carries its day's slot");
            assert_eq!(memory.window_day, day.to_string());
            assert!(*queued_at_ns >= ns(slot), "{zone}: {pass_id} queued before its slot");
            if *day != first_day {
                assert!(
                    from_ns(*queued_at_ns) - slot <= SignedDuration::from_mins(SLOT_DELAY_MAX_MINUTES),
                    "{zone}: {pass_id} queued at {}, long after its slot {}",
                    sim.calendar.local_label(from_ns(*queued_at_ns)),
                    memory.slot_label
                );
            }
        }
        let outcomes: Vec<&MemoryOutcomeRecord> =
            sim.outcomes.iter().filter(|o| o.pass_id.starts_with(&format!("memory-pass:{agent_id}:"))).collect();
        assert_eq!(outcomes.len(), days as usize, "{zone}: one outcome per pass of {agent_id}");
        assert!(outcomes.iter().all(|o| o.outcome == MemoryOutcome::Completed));
    }
    assert_eq!(sim.queued.len(), SIMULATED.len() * days as usize, "{zone}: no pass for anyone else");

    let idle = sim.log.state.memory_gate(IDLE);
    assert_eq!(idle.last_outcome, None, "{zone}: an agent with no history has no outcome record");
    assert_eq!((idle.newest_history_seq, idle.newest_outcome_seq), (0, 0));
    assert!(sim.log.state.queue(IDLE).is_none_or(|q| q.nothing_queued() && q.active.is_none()));
    let end_plan = sim.log.state.memory_plan(sim.log.positions.last().unwrap().at_ns);
    assert_eq!(status_of(&end_plan, IDLE), PassStatus::NoNewHistory);

    assert_eq!(sim.open_max, SIMULATED_MAX_CONCURRENT as usize, "{zone}: maxConcurrent held and was used");

    let mut actual = String::new();
    for (agent_id, pass_id, memory, queued_at_ns) in &sim.queued {
        if memory.window_day == transition_day.to_string() {
            let queued = sim.calendar.local_label(from_ns(*queued_at_ns));
            writeln!(
                actual,
                "{agent_id}: slot {} = {}, queued {queued}",
                memory.slot_label,
                from_ns(memory.slot_at_ns)
            )
            .unwrap();
            assert!(pass_id.ends_with(&memory.window_day));
        }
    }
    expect.assert_eq(&actual);
}

#[test]
fn new_york_spring_forward_moves_slots_in_the_gap_an_hour_later_and_keeps_one_pass_a_day() {
    // 2026-03-08 02:00 EST -> 03:00 EDT: ivy's 02:14 and fay's 02:53 do not exist that day.
    check_simulation(
        "America/New_York",
        date(2026, 3, 3),
        10,
        date(2026, 3, 8),
        expect![[r#"
            zed: slot 2026-03-08 01:00 EST = 2026-03-08T06:00:00Z, queued 2026-03-08 01:00 EST
            bo: slot 2026-03-08 01:47 EST = 2026-03-08T06:47:00Z, queued 2026-03-08 03:00 EDT
            ivy: slot 2026-03-08 03:14 EDT = 2026-03-08T07:14:00Z, queued 2026-03-08 04:00 EDT
            fay: slot 2026-03-08 03:53 EDT = 2026-03-08T07:53:00Z, queued 2026-03-08 05:00 EDT
        "#]],
    );
}

#[test]
fn new_york_fall_back_takes_the_first_of_two_slots_and_keeps_one_pass_a_day() {
    // 2026-11-01 02:00 EDT -> 01:00 EST: zed's 01:00 and bo's 01:47 happen twice that day.
    check_simulation(
        "America/New_York",
        date(2026, 10, 27),
        10,
        date(2026, 11, 1),
        expect![[r#"
            zed: slot 2026-11-01 01:00 EDT = 2026-11-01T05:00:00Z, queued 2026-11-01 01:00 EDT
            bo: slot 2026-11-01 01:47 EDT = 2026-11-01T05:47:00Z, queued 2026-11-01 01:00 EST
            ivy: slot 2026-11-01 02:14 EST = 2026-11-01T07:14:00Z, queued 2026-11-01 02:30 EST
            fay: slot 2026-11-01 02:53 EST = 2026-11-01T07:53:00Z, queued 2026-11-01 03:30 EST
        "#]],
    );
}

#[test]
fn london_across_both_dst_changes_keeps_one_pass_a_day() {
    // 2026-03-29 01:00 GMT -> 02:00 BST: zed's 01:00 and bo's 01:47 do not exist that day. bo's
    // slot moves past ivy's, and the limit goes in slot order.
    check_simulation(
        "Europe/London",
        date(2026, 3, 24),
        10,
        date(2026, 3, 29),
        expect![[r#"
            zed: slot 2026-03-29 02:00 BST = 2026-03-29T01:00:00Z, queued 2026-03-29 02:00 BST
            ivy: slot 2026-03-29 02:14 BST = 2026-03-29T01:14:00Z, queued 2026-03-29 03:00 BST
            bo: slot 2026-03-29 02:47 BST = 2026-03-29T01:47:00Z, queued 2026-03-29 04:00 BST
            fay: slot 2026-03-29 02:53 BST = 2026-03-29T01:53:00Z, queued 2026-03-29 05:00 BST
        "#]],
    );
    // 2026-10-25 02:00 BST -> 01:00 GMT: zed's 01:00 and bo's 01:47 happen twice that day.
    check_simulation(
        "Europe/London",
        date(2026, 10, 20),
        10,
        date(2026, 10, 25),
        expect![[r#"
            zed: slot 2026-10-25 01:00 BST = 2026-10-25T00:00:00Z, queued 2026-10-25 01:00 BST
            bo: slot 2026-10-25 01:47 BST = 2026-10-25T00:47:00Z, queued 2026-10-25 01:00 GMT
            ivy: slot 2026-10-25 02:14 GMT = 2026-10-25T02:14:00Z, queued 2026-10-25 02:30 GMT
            fay: slot 2026-10-25 02:53 GMT = 2026-10-25T02:53:00Z, queued 2026-10-25 03:30 GMT
        "#]],
    );
}

#[test]
fn lord_howe_half_hour_dst_changes_keep_one_pass_a_day() {
    // 2026-04-05 02:00 +11 -> 01:30 +1030: bo's 01:47 happens twice that day.
    check_simulation(
        "Australia/Lord_Howe",
        date(2026, 3, 31),
        10,
        date(2026, 4, 5),
        expect![[r#"
            zed: slot 2026-04-05 01:00 +11 = 2026-04-04T14:00:00Z, queued 2026-04-05 01:00 +11
            bo: slot 2026-04-05 01:47 +11 = 2026-04-04T14:47:00Z, queued 2026-04-05 01:30 +1030
            ivy: slot 2026-04-05 02:14 +1030 = 2026-04-04T15:44:00Z, queued 2026-04-05 02:30 +1030
            fay: slot 2026-04-05 02:53 +1030 = 2026-04-04T16:23:00Z, queued 2026-04-05 03:30 +1030
        "#]],
    );
    // 2026-10-04 02:00 +1030 -> 02:30 +11: ivy's 02:14 does not exist that day.
    check_simulation(
        "Australia/Lord_Howe",
        date(2026, 9, 29),
        10,
        date(2026, 10, 4),
        expect![[r#"
            zed: slot 2026-10-04 01:00 +1030 = 2026-10-03T14:30:00Z, queued 2026-10-04 01:00 +1030
            bo: slot 2026-10-04 01:47 +1030 = 2026-10-03T15:17:00Z, queued 2026-10-04 02:30 +11
            ivy: slot 2026-10-04 02:44 +11 = 2026-10-03T15:44:00Z, queued 2026-10-04 03:30 +11
            fay: slot 2026-10-04 02:53 +11 = 2026-10-03T15:53:00Z, queued 2026-10-04 04:30 +11
        "#]],
    );
}

/// Read literally: the latest slot at or before now is due, and an agent is
/// eligible while its history is newer than its last outcome. So a window-day whose slot found
/// nothing new stays due until the next slot, and the first history after it queues that day's
/// pass at once, outside the window; the next slot then finds nothing newer than that outcome.
/// An agent with one burst of history a day gets every pass right after it, here at 09:00 with
/// a window of 05:00-07:00 (and with the burst before the slot, at 04:00, yesterday's pass).
#[test]
fn one_burst_of_history_a_day_runs_each_pass_right_after_it_not_in_the_window() {
    let mut out = String::new();
    for (first, second) in
        [("2026-06-01T09:00:00Z", "2026-06-02T09:00:00Z"), ("2026-06-01T04:00:00Z", "2026-06-02T04:00:00Z")]
    {
        let mut fleet = Fleet::new("2026-05-31T23:00:00Z", &["zed"]);
        for (burst, slot) in [(first, "2026-06-02T05:00:00Z"), (second, "2026-06-03T05:00:00Z")] {
            fleet.post_at(burst, "zed");
            let plan = fleet.plan(burst);
            let zed = plan.entries.iter().find(|e| e.agent == "zed").unwrap();
            let window_day = zed.due.as_ref().unwrap().local_date_label();
            let request = fleet.then(pass_request("zed", &window_day));
            writeln!(out, "history at {burst}: {}", fleet.describe(request)).unwrap();
            if matches!(fleet.verdict(request), Verdict::MemoryPassQueued { .. }) {
                fleet.run_pass("zed");
            }
            let plan = fleet.plan(slot);
            let zed = plan.entries.iter().find(|e| e.agent == "zed").unwrap();
            writeln!(out, "  at the slot {slot}: {} ({})", zed.status.as_str(), zed.why).unwrap();
        }
    }
    expect![[r#"
        history at 2026-06-01T09:00:00Z: queued memory-pass:zed:2026-06-01
          at the slot 2026-06-02T05:00:00Z: no_new_history (no new history: the newest entry (seq 2) is older than the last outcome (seq 6))
        history at 2026-06-02T09:00:00Z: queued memory-pass:zed:2026-06-02
          at the slot 2026-06-03T05:00:00Z: no_new_history (no new history: the newest entry (seq 7) is older than the last outcome (seq 11))
        history at 2026-06-01T04:00:00Z: queued memory-pass:zed:2026-05-31
          at the slot 2026-06-02T05:00:00Z: no_new_history (no new history: the newest entry (seq 2) is older than the last outcome (seq 6))
        history at 2026-06-02T04:00:00Z: queued memory-pass:zed:2026-06-01
          at the slot 2026-06-03T05:00:00Z: no_new_history (no new history: the newest entry (seq 7) is older than the last outcome (seq 11))
    "#]].assert_eq(&out);
}

// ---------------------------------------------------------------------------------------------
// 2. maxConcurrent.

/// zed, bo and ivy each posted at 03:00 UTC; by 07:00 all three slots (05:00, 05:47, 06:14) are
/// due. Default configuration: maxConcurrent 1.
fn three_due_agents() -> Fleet {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed", "bo", "ivy"]);
    for agent_id in ["zed", "bo", "ivy"] {
        fleet.post(agent_id);
    }
    fleet
}

#[test]
fn with_max_concurrent_one_the_passes_run_one_after_another_in_slot_order() {
    let mut fleet = three_due_agents();
    let mut out = describe_plan(&fleet.plan("2026-06-01T07:00:00Z"));
    let zed = fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    let bo = fleet.then(pass_request("bo", "2026-06-01"));
    writeln!(out, "zed: {}\nbo: {}", fleet.describe(zed), fleet.describe(bo)).unwrap();
    out += &describe_plan(&fleet.plan("2026-06-01T07:01:00Z"));
    let finished = fleet.run_pass("zed");
    writeln!(out, "zed: {}", fleet.describe(finished)).unwrap();
    out += &describe_plan(&fleet.plan("2026-06-01T07:30:00Z"));
    let bo = fleet.at("2026-06-01T07:30:00Z", pass_request("bo", "2026-06-01"));
    writeln!(out, "bo: {}", fleet.describe(bo)).unwrap();
    expect![[r#"
        open passes: 0
        zed due [2026-06-01 05:00 UTC]: due since 2026-06-01 05:00 UTC and history is newer than the last outcome
        bo waiting_for_limit [2026-06-01 05:47 UTC]: due since 2026-06-01 05:47 UTC, but 0 passes are open and earlier slots take the rest of maxConcurrent 1
        ivy waiting_for_limit [2026-06-01 06:14 UTC]: due since 2026-06-01 06:14 UTC, but 0 passes are open and earlier slots take the rest of maxConcurrent 1
        zed: queued memory-pass:zed:2026-06-01
        bo: refused Aborted: 1 memory passes are queued or running; maxConcurrent is 1
        open passes: 1
        zed open [2026-06-01 05:00 UTC]: the pass of 2026-06-01 is queued (queued at seq 7)
        bo waiting_for_limit [2026-06-01 05:47 UTC]: due since 2026-06-01 05:47 UTC, but 1 passes are open and earlier slots take the rest of maxConcurrent 1
        ivy waiting_for_limit [2026-06-01 06:14 UTC]: due since 2026-06-01 06:14 UTC, but 1 passes are open and earlier slots take the rest of maxConcurrent 1
        zed: finished memory-pass:zed:2026-06-01 (completed)
        open passes: 0
        zed already_done [2026-06-01 05:00 UTC]: the pass of 2026-06-01 already ran (completed at seq 11)
        bo due [2026-06-01 05:47 UTC]: due since 2026-06-01 05:47 UTC and history is newer than the last outcome
        ivy waiting_for_limit [2026-06-01 06:14 UTC]: due since 2026-06-01 06:14 UTC, but 0 passes are open and earlier slots take the rest of maxConcurrent 1
        bo: queued memory-pass:bo:2026-06-01
    "#]]
    .assert_eq(&out);
}

#[test]
fn two_instances_ticking_at_once_queue_exactly_one_pass_under_max_concurrent_one() {
    // Two engine instances each read a plan and append a request for a different agent, back to
    // back, in either order: the log's order decides, and exactly one is accepted.
    for (first, second) in [("zed", "bo"), ("bo", "zed")] {
        let mut fleet = three_due_agents();
        let a = fleet.at("2026-06-01T07:00:00Z", pass_request(first, "2026-06-01"));
        let b = fleet.at("2026-06-01T07:00:00Z", pass_request(second, "2026-06-01"));
        let accepted =
            [a, b].iter().filter(|&&seq| matches!(fleet.verdict(seq), Verdict::MemoryPassQueued { .. })).count();
        assert_eq!(accepted, 1, "{first} then {second}: {} / {}", fleet.describe(a), fleet.describe(b));
        assert_eq!(fleet.describe(a), format!("queued memory-pass:{first}:2026-06-01"));
        assert!(
            matches!(fleet.verdict(b), Verdict::Refused(r) if r.kind == RefusalKind::Aborted),
            "{}",
            fleet.describe(b)
        );
        assert_eq!(fleet.open_passes(), 1);
        assert!(fleet.describe_queue(second).starts_with("queued: -\n"));
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Outcomes.

/// zed posted at 03:00 UTC; its pass of 2026-06-01 (slot 05:00) was queued at 07:00, claimed at
/// 07:02 and started a second later.
fn zed_pass_running() -> Fleet {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed"]);
    fleet.post("zed");
    let queued = fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    assert_eq!(fleet.describe(queued), "queued memory-pass:zed:2026-06-01");
    fleet.at("2026-06-01T07:02:00Z", claim_with_memory_md("zed", "w1", 100));
    let started = fleet.then(start("zed", "w1"));
    assert_eq!(fleet.describe(started), "started memory-pass:zed:2026-06-01");
    fleet
}

/// Finishes zed's running pass at 07:30 with `finish`: the verdict, the outcome recorded, zed's
/// queue, and the passes open after it.
#[track_caller]
fn check_finish(finish: Envelope, expect: Expect) {
    let mut fleet = zed_pass_running();
    let seq = fleet.at("2026-06-01T07:30:00Z", finish);
    let mut out = fleet.describe(seq) + "\n";
    out += &fleet.describe_outcome("zed");
    out += &fleet.describe_queue("zed");
    writeln!(out, "open passes: {}", fleet.open_passes()).unwrap();
    expect.assert_eq(&out);
}

#[test]
fn a_pass_that_changed_the_memory_files_completed() {
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""),
        expect![[r#"
            finished memory-pass:zed:2026-06-01 (completed)
            outcome: completed of 2026-06-01 (slot 2026-06-01T05:00:00Z, started 2026-06-01T07:02:01Z, delay PT2H2M1S, finished 2026-06-01T07:30:00Z), reason: -
            queued: -
            active: none
            open passes: 0
        "#]],
    );
}

#[test]
fn a_pass_that_changed_nothing_was_quietly_skipped() {
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Completed, &digest(7), &digest(7), ""),
        expect![[r#"
            finished memory-pass:zed:2026-06-01 (quiet_skipped)
            outcome: quiet_skipped of 2026-06-01 (slot 2026-06-01T05:00:00Z, started 2026-06-01T07:02:01Z, delay PT2H2M1S, finished 2026-06-01T07:30:00Z), reason: -
            queued: -
            active: none
            open passes: 0
        "#]],
    );
}

#[test]
fn a_failed_pass_records_the_reason() {
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Failed, &[], &[], "model error: context window exceeded"),
        expect![[r#"
            finished memory-pass:zed:2026-06-01 (failed)
            outcome: failed of 2026-06-01 (slot 2026-06-01T05:00:00Z, started 2026-06-01T07:02:01Z, delay PT2H2M1S, finished 2026-06-01T07:30:00Z), reason: model error: context window exceeded
            queued: -
            active: none
            open passes: 0
        "#]],
    );
}

#[test]
fn an_aborted_pass_that_was_not_drained_failed() {
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Aborted, &[], &[], "operator cancelled the turn"),
        expect![[r#"
            finished memory-pass:zed:2026-06-01 (failed)
            outcome: failed of 2026-06-01 (slot 2026-06-01T05:00:00Z, started 2026-06-01T07:02:01Z, delay PT2H2M1S, finished 2026-06-01T07:30:00Z), reason: operator cancelled the turn
            queued: -
            active: none
            open passes: 0
        "#]],
    );
}

#[test]
fn a_completed_pass_without_digests_is_refused_and_keeps_running() {
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Completed, &[], &[], ""),
        expect![[r#"
            refused InvalidArgument: memory_digest_before: a completed memory pass carries a SHA-256 digest of 32 bytes (got 0)
            outcome: none
            queued: -
            active: memory-pass:zed:2026-06-01 running
            open passes: 1
        "#]],
    );
    check_finish(
        finish_pass("zed", "w1", WakeOutcome::Completed, &digest(1), &[2; 31], ""),
        expect![[r#"
            refused InvalidArgument: memory_digest_after: a completed memory pass carries a SHA-256 digest of 32 bytes (got 31)
            outcome: none
            queued: -
            active: memory-pass:zed:2026-06-01 running
            open passes: 1
        "#]],
    );
    // The runtime retries with the digests: the pass completes.
    let mut fleet = zed_pass_running();
    fleet.at("2026-06-01T07:30:00Z", finish_pass("zed", "w1", WakeOutcome::Completed, &[], &[], ""));
    let retried = fleet.then(finish_pass("zed", "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""));
    assert_eq!(fleet.describe(retried), "finished memory-pass:zed:2026-06-01 (completed)");
}

#[test]
fn a_restart_drain_records_nothing_and_requeues_the_pass_once() {
    // maxConcurrent 2; zed's pass is running, bo and ivy are due too.
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed", "bo", "ivy"]);
    fleet.then(configured(memory_config("UTC", "05:00", 2)));
    for agent_id in ["zed", "bo", "ivy"] {
        fleet.post(agent_id);
    }
    fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    fleet.at("2026-06-01T07:02:00Z", claim("zed", "w1"));
    fleet.then(start("zed", "w1"));
    let drained = fleet.at("2026-06-01T07:10:00Z", restart_drain("zed", "w1"));
    let mut out = fleet.describe(drained) + "\n";
    out += &fleet.describe_outcome("zed");
    out += &fleet.describe_queue("zed");
    out += &describe_plan(&fleet.plan("2026-06-01T07:11:00Z"));
    // The drained pass still counts once: one more fits, a third does not.
    let bo = fleet.at("2026-06-01T07:11:00Z", pass_request("bo", "2026-06-01"));
    let ivy = fleet.then(pass_request("ivy", "2026-06-01"));
    writeln!(out, "bo: {}\nivy: {}", fleet.describe(bo), fleet.describe(ivy)).unwrap();
    // A new worker claims it again: it resumes.
    let claim = fleet.at("2026-06-01T07:20:00Z", claim("zed", "w2"));
    let Verdict::Claim(ClaimVerdict::Claimed(claimed)) = fleet.verdict(claim).clone() else {
        panic!("the drained pass is claimable again: {}", fleet.describe(claim));
    };
    assert!(claimed.item.resume_after_restart);
    let text = render::render_wake_text("zed", &claimed, &RowBody::default(), &[]);
    assert!(text.contains("[anima] A runtime restart interrupted this memory pass."), "{text}");
    fleet.then(start("zed", "w2"));
    let finished = fleet.then(finish_pass("zed", "w2", WakeOutcome::Completed, &digest(1), &digest(2), ""));
    writeln!(out, "zed: {}", fleet.describe(finished)).unwrap();
    out += &fleet.describe_outcome("zed");
    writeln!(out, "open passes: {}", fleet.open_passes()).unwrap();
    expect![[r#"
        finished memory-pass:zed:2026-06-01, re-queued
        outcome: none
        queued: memory-pass:zed:2026-06-01 memory resume
        active: none
        open passes: 1
        zed open [2026-06-01 05:00 UTC]: the pass of 2026-06-01 is running (queued at seq 8)
        bo due [2026-06-01 05:47 UTC]: due since 2026-06-01 05:47 UTC and history is newer than the last outcome
        ivy waiting_for_limit [2026-06-01 06:14 UTC]: due since 2026-06-01 06:14 UTC, but 1 passes are open and earlier slots take the rest of maxConcurrent 2
        bo: queued memory-pass:bo:2026-06-01
        ivy: refused Aborted: 2 memory passes are queued or running; maxConcurrent is 2
        zed: finished memory-pass:zed:2026-06-01 (completed)
        outcome: completed of 2026-06-01 (slot 2026-06-01T05:00:00Z, started 2026-06-01T07:02:01Z, delay PT2H2M1S, finished 2026-06-01T07:20:02Z), reason: -
        open passes: 1
    "#]]
    .assert_eq(&out);
}

#[test]
fn a_failed_pass_closes_the_gate_until_new_history() {
    let mut fleet = zed_pass_running();
    fleet.at("2026-06-01T07:30:00Z", finish_pass("zed", "w1", WakeOutcome::Failed, &[], &[], "crashed"));
    // The next day, with nothing new: no pass.
    let plan = fleet.plan("2026-06-02T07:00:00Z");
    assert_eq!(status_of(&plan, "zed"), PassStatus::NoNewHistory, "{}", describe_plan(&plan));
    let refused = fleet.at("2026-06-02T07:00:00Z", pass_request("zed", "2026-06-02"));
    // With a post later that day: one pass, for that day.
    let posted = fleet.post_at("2026-06-02T09:00:00Z", "zed");
    let plan = fleet.plan("2026-06-02T09:30:00Z");
    assert_eq!(status_of(&plan, "zed"), PassStatus::Due, "{}", describe_plan(&plan));
    let accepted = fleet.at("2026-06-02T09:30:00Z", pass_request("zed", "2026-06-02"));
    let again = fleet.then(pass_request("zed", "2026-06-02"));
    expect![[r#"
        refused FailedPrecondition: no new history: the newest entry (seq 2) is older than the last outcome (seq 6)
        journaled #2
        queued memory-pass:zed:2026-06-02
        refused Aborted: the pass of 2026-06-02 is queued (queued at seq 9)
    "#]]
    .assert_eq(&[refused, posted, accepted, again].map(|seq| fleet.describe(seq) + "\n").concat());
}

// ---------------------------------------------------------------------------------------------
// 4. The plan says why.

#[test]
fn the_plan_explains_each_agents_status() {
    // maxConcurrent 2, a scope that leaves oz out and lists ghost, who is not registered.
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed", "bo", "ivy", "fay", "idle", "oz"]);
    let mut config = memory_config("UTC", "05:00", 2);
    config.scope_agent_ids = ["zed", "bo", "ivy", "fay", "idle", "ghost"].map(str::to_owned).to_vec();
    fleet.then(configured(config.clone()));
    for agent_id in ["zed", "bo", "ivy", "fay", "oz"] {
        fleet.post(agent_id);
    }
    // zed's pass ran; bo's is queued.
    fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    fleet.run_pass("zed");
    fleet.then(pass_request("bo", "2026-06-01"));
    let mut out = describe_plan(&fleet.plan("2026-06-01T07:30:00Z"));
    // Running, not queued, once started.
    fleet.then(claim("bo", "w1"));
    fleet.then(start("bo", "w1"));
    let plan = fleet.plan("2026-06-01T07:30:00Z");
    let bo = plan.entries.iter().find(|e| e.agent == "bo").unwrap();
    writeln!(out, "bo {} [{}]: {}", bo.status.as_str(), bo.due_label, bo.why).unwrap();
    // The next day zed has nothing new since its outcome.
    let plan = fleet.plan("2026-06-02T07:30:00Z");
    let zed = plan.entries.iter().find(|e| e.agent == "zed").unwrap();
    writeln!(out, "zed {} [{}]: {}", zed.status.as_str(), zed.due_label, zed.why).unwrap();
    expect![[r#"
        open passes: 1
        zed already_done [2026-06-01 05:00 UTC]: the pass of 2026-06-01 already ran (completed at seq 16)
        idle no_new_history [2026-06-01 05:08 UTC]: no history: no wake was queued and no send confirmed for this agent
        bo open [2026-06-01 05:47 UTC]: the pass of 2026-06-01 is queued (queued at seq 17)
        ivy due [2026-06-01 06:14 UTC]: due since 2026-06-01 06:14 UTC and history is newer than the last outcome
        ghost not_registered [2026-06-01 06:15 UTC]: the scope lists this agent but it is not registered
        oz out_of_scope [2026-06-01 06:24 UTC]: memoryCoherence.scopeAgentIds does not list this agent
        fay waiting_for_limit [2026-06-01 06:53 UTC]: due since 2026-06-01 06:53 UTC, but 1 passes are open and earlier slots take the rest of maxConcurrent 2
        bo open [2026-06-01 05:47 UTC]: the pass of 2026-06-01 is running (queued at seq 17)
        zed no_new_history [2026-06-02 05:00 UTC]: no new history: the newest entry (seq 8) is older than the last outcome (seq 16)
    "#]]
    .assert_eq(&out);

    // Requests follow the plan: out of scope, not registered, nothing new, already done.
    let mut refusals = String::new();
    for agent_id in ["oz", "ghost", "idle", "zed"] {
        let seq = fleet.at("2026-06-01T07:40:00Z", pass_request(agent_id, "2026-06-01"));
        writeln!(refusals, "{agent_id}: {}", fleet.describe(seq)).unwrap();
    }
    expect![[r#"
        oz: refused FailedPrecondition: memoryCoherence.scopeAgentIds does not list this agent
        ghost: refused InvalidArgument: agent "ghost" is not registered
        idle: refused FailedPrecondition: no history: no wake was queued and no send confirmed for this agent
        zed: refused Aborted: the pass of 2026-06-01 already ran (completed at seq 16)
    "#]]
    .assert_eq(&refusals);
}

#[test]
fn an_agent_whose_pass_ran_today_is_done_even_with_new_history() {
    let mut fleet = zed_pass_running();
    fleet.at("2026-06-01T07:30:00Z", finish_pass("zed", "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""));
    fleet.post_at("2026-06-01T08:00:00Z", "zed");
    let plan = fleet.plan("2026-06-01T08:30:00Z");
    assert_eq!(status_of(&plan, "zed"), PassStatus::AlreadyDone, "{}", describe_plan(&plan));
    let again = fleet.at("2026-06-01T08:30:00Z", pass_request("zed", "2026-06-01"));
    assert_eq!(
        fleet.describe(again),
        "refused Aborted: the pass of 2026-06-01 already ran (completed at seq 6)",
        "one pass per window-day"
    );
    // Tomorrow that history earns the next pass.
    let plan = fleet.plan("2026-06-02T05:00:00Z");
    assert_eq!(status_of(&plan, "zed"), PassStatus::Due, "{}", describe_plan(&plan));
}

#[test]
fn a_disabled_configuration_plans_and_queues_nothing() {
    let mut fleet = three_due_agents();
    let mut config = memory_config("UTC", "05:00", 1);
    config.enabled = false;
    fleet.then(configured(config));
    let plan = fleet.plan("2026-06-01T07:00:00Z");
    assert_eq!(plan.due().count(), 0);
    let request = fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    expect![[r#"
        open passes: 0
        zed disabled [2026-06-01 05:00 UTC]: memory passes are disabled (memoryCoherence.enabled = false)
        bo disabled [2026-06-01 05:47 UTC]: memory passes are disabled (memoryCoherence.enabled = false)
        ivy disabled [2026-06-01 06:14 UTC]: memory passes are disabled (memoryCoherence.enabled = false)
        zed: refused FailedPrecondition: memory passes are disabled (memoryCoherence.enabled = false)
    "#]]
    .assert_eq(&(describe_plan(&plan) + &format!("zed: {}\n", fleet.describe(request))));
}

// ---------------------------------------------------------------------------------------------
// 5. Requests are judged by log time.

#[test]
fn a_request_for_yesterday_is_refused_once_todays_slot_is_due() {
    // zed posted in the evening of 05-31, after that day's slot; no pass was requested that day.
    let mut fleet = Fleet::new("2026-05-31T20:00:00Z", &["zed"]);
    fleet.post("zed");
    // A scheduler that read its plan before 05:00 asks for 05-31; its request lands at 05:30.
    let stale = fleet.at("2026-06-01T05:30:00Z", pass_request("zed", "2026-05-31"));
    let fresh = fleet.then(pass_request("zed", "2026-06-01"));
    expect![[r#"
        refused Aborted: the slot due at this log time is the one of 2026-06-01, not of "2026-05-31"
        queued memory-pass:zed:2026-06-01
    "#]]
    .assert_eq(&[stale, fresh].map(|seq| fleet.describe(seq) + "\n").concat());
}

#[test]
fn a_request_before_the_days_slot_is_refused() {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed"]);
    fleet.post("zed");
    // zed's slot is 05:00 UTC.
    let early = fleet.at("2026-06-01T04:58:00Z", pass_request("zed", "2026-06-01"));
    let tomorrow = fleet.at("2026-06-01T04:58:01Z", pass_request("zed", "2026-06-02"));
    let on_time = fleet.at("2026-06-01T05:00:00Z", pass_request("zed", "2026-06-01"));
    expect![[r#"
        refused Aborted: the slot due at this log time is the one of 2026-05-31, not of "2026-06-01"
        refused Aborted: the slot due at this log time is the one of 2026-05-31, not of "2026-06-02"
        queued memory-pass:zed:2026-06-01
    "#]]
    .assert_eq(&[early, tomorrow, on_time].map(|seq| fleet.describe(seq) + "\n").concat());
}

#[test]
fn an_invalid_configuration_is_refused_naming_the_key_and_the_previous_one_stays() {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed"]);
    let valid = memory_config("Europe/London", "02:00", 2);
    let configured_seq = fleet.then(configured(valid.clone()));
    assert_eq!(fleet.describe(configured_seq), "configured");
    let in_force = fleet.log.state.memory_config();
    assert_eq!(in_force.settings.timezone, "Europe/London");
    let mut out = String::new();
    let invalid = [
        proto::MemoryCoherenceConfigured { max_concurrent: 0, ..valid.clone() },
        proto::MemoryCoherenceConfigured { timezone: "Mars/Base".to_owned(), ..valid.clone() },
        proto::MemoryCoherenceConfigured { window_start: "25:00".to_owned(), ..valid.clone() },
    ];
    for config in invalid {
        let seq = fleet.then(configured(config));
        assert!(matches!(fleet.verdict(seq), Verdict::Refused(r) if r.kind == RefusalKind::InvalidArgument));
        writeln!(out, "{}", fleet.describe(seq)).unwrap();
        assert_eq!(fleet.log.state.memory_config(), in_force, "a refused configuration changed the one in force");
    }
    expect![[r#"
        refused InvalidArgument: memoryCoherence.maxConcurrent: expected 1..=100, got 0
        refused InvalidArgument: memoryCoherence.timezone: "Mars/Base" is not an IANA time zone name (not in the bundled tz database)
        refused InvalidArgument: memoryCoherence.windowStart: expected a local time HH:MM between 00:00 and 23:59, got "25:00"
    "#]]
    .assert_eq(&out);
    // Slots still follow London at 02:00 (zed's offset is 0).
    let plan = fleet.plan("2026-06-01T03:00:00Z");
    assert_eq!(plan.entries[0].due_label, "2026-06-01 02:00 BST");
}

// ---------------------------------------------------------------------------------------------
// 6. Wake text.

/// zed talked with a human and posted on `day`; its pass of that day (slot 05:00 local, zed's
/// offset being 0) is requested at 08:00 local and claimed with `memory_md_bytes`. With a
/// `threshold`, the log configures New York and that consolidation threshold; without, the log
/// holds no configuration (UTC, 20 KiB). The rendered text must show nothing of the conversation.
fn claimed_pass(day: Date, memory_md_bytes: u64, threshold: Option<u64>) -> (ClaimedWake, String) {
    let zone = if threshold.is_some() { "America/New_York" } else { "UTC" };
    let tz = jiff::tz::TimeZone::get(zone).unwrap();
    let local = |hour: i8| day.at(hour, 0, 0, 0).to_zoned_datetime(tz.clone()).unwrap().timestamp();
    let mut fleet = Fleet { log: TestLog::new(), posts: 0 };
    fleet.fold_at(local(1), registered("zed"));
    if let Some(threshold) = threshold {
        let mut config = memory_config(zone, "05:00", 1);
        config.consolidation_threshold_bytes = threshold;
        fleet.then(configured(config));
    }
    fleet.then(dm_from_human("zed", "DZED", &ts(1), "the vault code is 4417, keep it secret"));
    fleet.run_conversation_wake("zed");
    fleet.then(confirmed("zed", "DZED", &ts(2), "noted, I will never repeat 4417"));
    let queued = fleet.fold_at(local(8), pass_request("zed", &day.to_string()));
    assert!(matches!(fleet.verdict(queued), Verdict::MemoryPassQueued { .. }), "{}", fleet.describe(queued));
    let seq = fleet.then(claim_with_memory_md("zed", "w1", memory_md_bytes));
    let Verdict::Claim(ClaimVerdict::Claimed(claimed)) = fleet.verdict(seq).clone() else {
        panic!("the pass is claimable: {}", fleet.describe(seq));
    };
    let text = render::render_wake_text("zed", &claimed, &RowBody::default(), &[]);
    for secret in ["4417", "vault", "Uma", "DZED", "U1"] {
        assert!(!text.contains(secret), "conversation content {secret:?} in a pass's wake text:\n{text}");
    }
    (*claimed, text)
}

#[test]
fn the_wake_text_of_a_pass_under_the_threshold_is_the_maintenance_form() {
    let (claimed, text) = claimed_pass(date(2026, 3, 9), 20 * 1024, Some(20 * 1024));
    assert_eq!(claimed.item.reply_to, SurfaceId::Memory { agent: "zed".into() });
    assert_eq!(claimed.item.reply_to.to_target().target, None, "a pass answers nobody");
    assert!(claimed.plan.is_empty(), "a pass moves no cursor");
    expect![[r#"
        [anima] memory pass
        === latest wake ===
        reason: memory
        time: 2026-03-09 12:00:00 UTC
        scheduled: 2026-03-09 09:00:00 UTC (2026-03-09 05:00 EDT)
        window_day: 2026-03-09
        form: maintenance
        This is your daily memory pass. It is for bringing MEMORY.md and notes/ up to date with what happened since the last pass, so that your next wakes start from an accurate picture. Nothing is waiting for an answer.
        === reply ===
        reply_to: none (a memory pass answers nobody); finish it with the digests of MEMORY.md and notes/ taken before and after
    "#]]
    .assert_eq(&text);
}

#[test]
fn the_wake_text_of_a_pass_over_the_threshold_is_the_consolidation_form() {
    let (_, text) = claimed_pass(date(2026, 1, 15), 20 * 1024 + 1, Some(20 * 1024));
    expect![[r#"
        [anima] memory pass
        === latest wake ===
        reason: memory
        time: 2026-01-15 13:00:00 UTC
        scheduled: 2026-01-15 10:00:00 UTC (2026-01-15 05:00 EST)
        window_day: 2026-01-15
        form: consolidation (MEMORY.md is 20481 bytes, above 20480)
        This is your daily memory pass. MEMORY.md has grown past the size it is meant to stay under: this pass is for consolidating it, so that what matters is short enough to be read on every wake, with details moved into notes/ and what no longer holds removed.
        === reply ===
        reply_to: none (a memory pass answers nobody); finish it with the digests of MEMORY.md and notes/ taken before and after
    "#]]
    .assert_eq(&text);
}

#[test]
fn the_consolidation_threshold_comes_from_the_configuration_and_defaults_to_20_kib() {
    let form = |memory_md_bytes: u64, threshold: Option<u64>| {
        let (_, text) = claimed_pass(date(2026, 6, 1), memory_md_bytes, threshold);
        text.lines().find(|l| l.starts_with("form: ")).unwrap().to_owned()
    };
    assert_eq!(form(4096, Some(4096)), "form: maintenance");
    assert_eq!(form(4097, Some(4096)), "form: consolidation (MEMORY.md is 4097 bytes, above 4096)");
    assert_eq!(form(20 * 1024, None), "form: maintenance");
    assert_eq!(form(20 * 1024 + 1, None), "form: consolidation (MEMORY.md is 20481 bytes, above 20480)");
}

// ---------------------------------------------------------------------------------------------
// 7. A pass is never coalesced into another wake.

#[test]
fn a_dm_wake_started_while_a_pass_is_queued_leaves_the_pass_queued() {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed"]);
    fleet.then(dm_from_human("zed", "DZED", &ts(1), "first"));
    fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    fleet.then(dm_from_human("zed", "DZED", &ts(2), "second"));
    let claim = fleet.then(claim("zed", "w1"));
    let started = fleet.then(start("zed", "w1"));
    let mut out = [claim, started].map(|seq| fleet.describe(seq) + "\n").concat();
    out += &fleet.describe_queue("zed");
    // The runtime also claims a DM by id past a queued pass.
    fleet.then(finish("zed", "w1", WakeOutcome::Completed));
    fleet.then(dm_from_human("zed", "DZED", &ts(3), "third"));
    let by_id = fleet.then(claim_item("zed", "w1", "slack:T1:DZED:1700000180.000100"));
    let started = fleet.then(start("zed", "w1"));
    out += &[by_id, started].map(|seq| fleet.describe(seq) + "\n").concat();
    out += &fleet.describe_queue("zed");
    expect![[r#"
        claimed slack:T1:DZED:1700000060.000100
        started slack:T1:DZED:1700000060.000100; settled without a turn: slack:T1:DZED:1700000120.000100
        queued: memory-pass:zed:2026-06-01 memory
        active: slack:T1:DZED:1700000060.000100 running
        claimed slack:T1:DZED:1700000180.000100
        started slack:T1:DZED:1700000180.000100
        queued: memory-pass:zed:2026-06-01 memory
        active: slack:T1:DZED:1700000180.000100 running
    "#]]
    .assert_eq(&out);
    assert_eq!(fleet.open_passes(), 1);
}

#[test]
fn one_agents_status_agrees_with_the_plan_and_answers_by_the_folds_own_limit_rule() {
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed", "bo", "ivy"]);
    for agent in ["zed", "bo", "ivy"] {
        fleet.post(agent);
    }
    let now = "2026-06-01T07:00:00Z";
    let status = |fleet: &Fleet, agent: &str| {
        let entry = fleet.log.state.memory_status(agent, ns(instant(now))).expect("a registered agent");
        entry.status
    };
    // The plan shares the one place in slot order; each agent alone would be accepted now.
    let plan = fleet.plan(now);
    let in_plan: Vec<PassStatus> =
        ["zed", "bo", "ivy"].map(|a| plan.entries.iter().find(|e| e.agent == a).expect("in the plan").status).to_vec();
    assert_eq!(in_plan, [PassStatus::Due, PassStatus::WaitingForLimit, PassStatus::WaitingForLimit]);
    for agent in ["zed", "bo", "ivy"] {
        assert_eq!(status(&fleet, agent), PassStatus::Due, "{agent}");
    }
    // Once zed's pass is open the limit is full: the others wait, zed's is open.
    let queued = fleet.at(now, pass_request("zed", "2026-06-01"));
    assert_eq!(fleet.describe(queued), "queued memory-pass:zed:2026-06-01");
    assert_eq!(status(&fleet, "zed"), PassStatus::Open);
    assert_eq!(status(&fleet, "bo"), PassStatus::WaitingForLimit);
    assert!(fleet.log.state.memory_status("nobody", ns(instant(now))).is_none());
}

// ---------------------------------------------------------------------------------------------
// Guards.

#[test]
fn a_running_memory_pass_is_sealed_no_send_and_no_linear_response() {
    let mut fleet = zed_pass_running();
    let cursors_before = fleet.log.cursors("zed");
    let sealed_send = fleet.at("2026-06-01T07:10:00Z", send("zed", "CZED"));
    let respond = fleet.then(event(
        "respond-from-the-pass".to_owned(),
        Payload::LinearResponse(proto::LinearResponseRequested {
            agent_id: "zed".to_owned(),
            session_id: "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01".to_owned(),
            kind: proto::LinearResponseKind::Response as i32,
            body: "posted from a pass".to_owned(),
            input_ids: Vec::new(),
        }),
    ));
    let out = format!("send: {}\nrespond: {}\n", fleet.describe(sealed_send), fleet.describe(respond));
    expect![[r#"
        send: refused FailedPrecondition: a memory pass does not post: zed's active wake is the memory pass memory-pass:zed:2026-06-01
        respond: refused FailedPrecondition: a memory pass does not post: zed's active wake is the memory pass memory-pass:zed:2026-06-01
    "#]]
    .assert_eq(&out);
    assert_eq!(fleet.log.cursors("zed"), cursors_before, "a sealed send moves no cursor");
    // Once the pass finished, the agent posts again.
    fleet.then(finish_pass("zed", "w1", WakeOutcome::Completed, &digest(1), &digest(2), ""));
    let after = fleet.then(send("zed", "CZED"));
    assert!(matches!(fleet.verdict(after), Verdict::Send(_)), "{}", fleet.describe(after));
}

#[test]
fn a_second_pass_is_refused_while_the_agents_earlier_pass_is_still_open() {
    // With maxConcurrent 2, yesterday's pass (queued, never claimed) must not let today's open
    // beside it: one open pass per agent.
    let mut fleet = Fleet::new("2026-06-01T03:00:00Z", &["zed"]);
    fleet.then(configured(memory_config("UTC", "05:00", 2)));
    fleet.post("zed");
    let first = fleet.at("2026-06-01T07:00:00Z", pass_request("zed", "2026-06-01"));
    fleet.post_at("2026-06-02T03:00:00Z", "zed");
    let second = fleet.at("2026-06-02T07:00:00Z", pass_request("zed", "2026-06-02"));
    let mut out = format!("day 1: {}\nday 2: {}\n", fleet.describe(first), fleet.describe(second));
    out += &describe_plan(&fleet.plan("2026-06-02T07:00:00Z"));
    expect![[r#"
        day 1: queued memory-pass:zed:2026-06-01
        day 2: refused Aborted: the pass of 2026-06-01 is queued (queued at seq 4)
        open passes: 1
        zed open [2026-06-02 05:00 UTC]: the pass of 2026-06-01 is queued (queued at seq 4)
    "#]]
    .assert_eq(&out);
}
