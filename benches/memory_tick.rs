//! The memory-pass scheduler's tick with 10,000 agents: `State::memory_plan`, which every tick
//! of every instance computes (each agent's due slot in the configured zone, its gate, the limit
//! shared out in slot order) before it appends any request.
//!
//! The fleet: 10,000 registered agents in America/New_York, each with a DM wake queued (history),
//! a third of them with a finished pass (gate closed), `maxConcurrent = 100`. The raw baseline is
//! the least a tick must do per agent: SHA-256 of its id for its offset
//! (`memory_slot::agent_offset_minutes`). Criterion measures each side; the printed ratio comes
//! from rounds that alternate the two.

use std::time::{Duration, Instant};

use anima_projections::memory::{MemoryConfig, PassStatus};
use anima_projections::memory_slot::agent_offset_minutes;
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::{LogPosition, State};
use criterion::{BenchmarkId, Criterion, SamplingMode};

use crate::measure::{interleave, median, Side};

const AGENTS: usize = 10_000;
const ROUNDS: usize = 20;
const QUICK_ROUNDS: usize = 2;
/// 2026-03-09T12:00:00Z: the day after New York's spring-forward.
const NOW_NS: i64 = 1_773_057_600 * 1_000_000_000;

struct Fleet {
    state: State,
    agents: Vec<String>,
}

impl Fleet {
    fn build() -> Fleet {
        let mut state = State::new();
        let mut seq = 0u64;
        let mut at_ns = NOW_NS - 3 * 24 * 3600 * 1_000_000_000;
        let mut apply = |state: &mut State, payload: Payload| {
            seq += 1;
            at_ns += 1_000_000;
            let envelope = proto::Envelope {
                event_id: format!("e{seq}"),
                min_reader_version: 1,
                source: "bench".into(),
                payload: Some(payload),
                ..Default::default()
            };
            state.apply(LogPosition { seq, at_ns }, &envelope);
        };
        let config = MemoryConfig::new(true, "02:00", 120, 100, "America/New_York", &[], 20 * 1024)
            .expect("a valid configuration");
        apply(&mut state, Payload::MemoryConfig(config.to_proto()));
        let agents: Vec<String> = (0..AGENTS).map(|n| format!("agent-{n:05}")).collect();
        for (n, agent) in agents.iter().enumerate() {
            apply(
                &mut state,
                Payload::AgentRegistered(proto::AgentRegistered {
                    agent_id: agent.clone(),
                    slack_bot_user_id: format!("UB{n:06}"),
                    ..Default::default()
                }),
            );
            apply(
                &mut state,
                Payload::SlackMessage(proto::SlackMessageObserved {
                    receiving_agent_id: agent.clone(),
                    kind: proto::SlackDeliveryKind::Message as i32,
                    team_id: "T1".into(),
                    channel_id: format!("D{n:06}"),
                    ts: format!("{}.000100", 1_772_000_000 + n),
                    user_id: "UPERSON".into(),
                    text: "hello".into(),
                    ..Default::default()
                }),
            );
        }
        Fleet { state, agents }
    }

    fn plan(&self) -> Duration {
        let started = Instant::now();
        let plan = std::hint::black_box(self.state.memory_plan(std::hint::black_box(NOW_NS)));
        let elapsed = started.elapsed();
        assert_eq!(plan.entries.len(), AGENTS);
        elapsed
    }

    /// What the engine's tick holds the state's lock for: reading the plan's facts.
    fn locked(&self) -> Duration {
        let started = Instant::now();
        let facts = std::hint::black_box(self.state.memory_plan_facts());
        let held = started.elapsed();
        assert_eq!(facts.agents.len(), AGENTS);
        held
    }

    fn offsets(&self) -> Duration {
        let started = Instant::now();
        for agent in &self.agents {
            std::hint::black_box(agent_offset_minutes(std::hint::black_box(agent), 120));
        }
        started.elapsed()
    }
}

/// Benchmarks the plan against the offsets alone; returns the summary line, or `None` when
/// filtered out.
pub fn bench(c: &mut Criterion, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("memory_tick");
    group.sampling_mode(SamplingMode::Flat);
    let mut fleet: Option<Fleet> = None;
    for (name, raw) in [("memory_plan", false), ("raw_agent_offsets", true)] {
        group.bench_function(BenchmarkId::new(name, AGENTS), |b| {
            let fleet = fleet.get_or_insert_with(Fleet::build);
            b.iter_custom(|iters| (0..iters).map(|_| if raw { fleet.offsets() } else { fleet.plan() }).sum())
        });
    }
    group.finish();
    let fleet = fleet?;
    let due = fleet.state.memory_plan(NOW_NS).entries.iter().filter(|e| e.status == PassStatus::Due).count();
    let runs = interleave(if quick { QUICK_ROUNDS } else { ROUNDS }, |side| match side {
        Side::Engine => fleet.plan(),
        Side::Raw => fleet.offsets(),
    });
    let plan = median(&runs.engine);
    let raw = median(&runs.raw);
    let locked: Vec<Duration> = (0..runs.engine.len()).map(|_| fleet.locked()).collect();
    let locked = median(&locked);
    Some(format!(
        "memory_tick: plan of {AGENTS} agents {:.1} ms ({:.2} µs/agent; {due} due, maxConcurrent 100), raw SHA-256 \
         offsets of the same ids {:.1} ms, ratio {:.1}× (median of {} interleaved rounds); of it the state's lock \
         is held {:.2} ms (the facts read), ratio {:.3} of the plan",
        plan.as_secs_f64() * 1e3,
        plan.as_secs_f64() * 1e6 / AGENTS as f64,
        raw.as_secs_f64() * 1e3,
        plan.as_secs_f64() / raw.as_secs_f64(),
        runs.engine.len(),
        locked.as_secs_f64() * 1e3,
        locked.as_secs_f64() / plan.as_secs_f64(),
    ))
}
