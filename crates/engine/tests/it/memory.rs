//! The memory-pass scheduler end to end in the engine: two in-process instances share one
//! embedded log and one injected clock, tick together every 30 minutes across six local days
//! that include the spring-forward day of America/New_York, and a runtime claims, starts and
//! finishes what they queue. Every agent with new history gets exactly one pass per local
//! window-day, at its slot; the agent without history gets none; `maxConcurrent = 1` holds at
//! every step although both instances request at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anima_engine::checkpoint::CheckpointStore;
use anima_engine::clock::{Clock, ManualClock};
use anima_engine::command::SlackObservation;
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::EventLog;
use anima_engine::{Engine, EngineConfig, Runner, RunnerConfig};
use anima_projections::memory::{MemoryConfig, MemoryOutcome};
use anima_projections::proto;
use anima_projections::wake::PlanEntry;
use tokio_util::sync::CancellationToken;

const MINUTE_NS: i64 = 60 * 1_000_000_000;
const AGENTS_WITH_HISTORY: [&str; 3] = ["ada", "bo", "cy"];
const AGENT_WITHOUT_HISTORY: &str = "dee";

struct Fleet {
    engines: Vec<Engine>,
    shutdown: CancellationToken,
    _dirs: Vec<tempfile::TempDir>,
}

/// Two engines over one embedded log stamped by `clock`.
async fn fleet(clock: Arc<ManualClock>) -> Fleet {
    let log_dir = tempfile::tempdir().expect("tempdir");
    let db = sled::Config::new().path(log_dir.path()).open().expect("sled");
    let config = EmbeddedConfig { clock: clock.clone(), ..EmbeddedConfig::default() };
    let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, config).expect("log"));
    let shutdown = CancellationToken::new();
    let mut engines = Vec::new();
    let mut dirs = vec![log_dir];
    for _ in 0..2 {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = anima_engine::checkpoint::CheckpointDb::open(dir.path(), 16 * 1024 * 1024).expect("store");
        let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("checkpoints");
        let runner =
            Runner::start(log.clone(), checkpoints, RunnerConfig::default(), shutdown.clone()).await.expect("runner");
        engines.push(Engine::new(log.clone(), runner.projection, EngineConfig::default()));
        dirs.push(dir);
    }
    Fleet { engines, shutdown, _dirs: dirs }
}

impl Fleet {
    /// Waits until both instances applied everything in the log.
    async fn settle(&self) {
        let last = self.engines[0].log().last_seq().await.expect("last seq");
        for engine in &self.engines {
            engine.projection().wait_applied(last, Duration::from_secs(20)).await.expect("caught up");
        }
    }

    fn open_passes(&self) -> usize {
        self.engines[0].projection().state().memory_open.len()
    }
}

fn local_ns(zone: &str, civil: &str) -> i64 {
    let zoned = civil.parse::<jiff::civil::DateTime>().expect("civil time").in_tz(zone).expect("zone");
    i64::try_from(zoned.timestamp().as_nanosecond()).expect("in range")
}

fn dm(agent: &str, n: u32, at_ns: i64) -> SlackObservation {
    SlackObservation {
        receiving_agent_ids: vec![agent.to_owned()],
        message: proto::SlackMessageObserved {
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: "T1".into(),
            channel_id: format!("D{agent}"),
            ts: format!("{}.{n:06}", at_ns / 1_000_000_000),
            user_id: "UPERSON".into(),
            text: format!("question {n} for {agent}"),
            ..Default::default()
        },
        occurred_at_ms: at_ns / 1_000_000,
    }
}

/// The runtime: claims everything claimable for `agent`, starts it with the plan it was given
/// and finishes it; a memory pass changes the memory files (different digests). Returns the
/// pass ids finished and their recorded outcomes.
async fn run_agent(engine: &Engine, agent: &str) -> Vec<(String, MemoryOutcome, i64)> {
    let mut passes = Vec::new();
    loop {
        let claim = proto::WakeClaimRequested {
            agent_id: agent.to_owned(),
            worker_id: "worker-1".into(),
            item_id: String::new(),
            memory_md_bytes: 4_000,
            claim_lease_seconds: 0,
        };
        let outcome = engine.claim(claim, "").await.expect("claim");
        let Some(wake) = outcome.wake else { return passes };
        let claimed = wake.claimed;
        let plan = claimed.plan.iter().map(PlanEntry::to_plan_surface).collect();
        let start = proto::WakeStartRequested {
            agent_id: agent.to_owned(),
            worker_id: "worker-1".into(),
            item_id: claimed.item.id.clone(),
            plan,
        };
        engine.start(start, "").await.expect("start");
        let is_pass = claimed.item.memory.is_some();
        if is_pass {
            assert!(wake.text.contains("memory pass"), "a pass's wake text says what it is:\n{}", wake.text);
            assert!(!wake.text.contains("question"), "a pass shows no conversation:\n{}", wake.text);
        }
        let finish = proto::WakeFinishRequested {
            agent_id: agent.to_owned(),
            worker_id: "worker-1".into(),
            item_id: claimed.item.id.clone(),
            outcome: proto::WakeOutcome::Completed as i32,
            memory_digest_before: if is_pass { vec![1; 32] } else { Vec::new() },
            memory_digest_after: if is_pass { vec![2; 32] } else { Vec::new() },
            ..Default::default()
        };
        let finished = engine.finish(finish, "").await.expect("finish");
        if let Some(record) = finished.memory_outcome {
            passes.push((record.pass_id, record.outcome, record.delay_ns.expect("started")));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_give_every_agent_with_history_one_pass_per_local_day_across_dst() {
    let zone = "America/New_York";
    // 2026-03-08 is the spring-forward day: 02:00-03:00 does not exist there.
    let clock = Arc::new(ManualClock::new(local_ns(zone, "2026-03-05T18:00")));
    let fleet = fleet(clock.clone()).await;
    let config = MemoryConfig::new(true, "02:00", 120, 1, zone, &[], 20 * 1024).expect("config");
    assert!(fleet.engines[0].sync_memory_config(&config).await.expect("config appended"));
    for agent in AGENTS_WITH_HISTORY.iter().chain([&AGENT_WITHOUT_HISTORY]) {
        let registration = proto::AgentRegistered {
            agent_id: (*agent).to_owned(),
            slack_bot_user_id: format!("UBOT{}", agent.to_uppercase()),
            ..Default::default()
        };
        fleet.engines[0].register_agent(registration).await.expect("register");
    }
    fleet.settle().await;
    assert!(!fleet.engines[1].sync_memory_config(&config).await.expect("sync"), "the log already holds it");

    let end = local_ns(zone, "2026-03-11T06:00");
    let mut finished: BTreeMap<String, Vec<(String, MemoryOutcome, i64)>> = BTreeMap::new();
    let mut message = 0;
    let mut max_open = 0;
    let mut refused = 0;
    while clock.now_ns() < end {
        clock.advance(Duration::from_secs(30 * 60));
        let now = clock.now_ns();
        // Every evening at 20:00 and 23:00 local, someone writes to each agent with history. The
        // first message of the simulation makes that day's pass due at once (catch-up); after
        // that, each day's pass already ran when the evening's messages arrive, and they wait
        // for the next day's slot.
        let local = jiff::Timestamp::from_nanosecond(i128::from(now)).expect("instant").in_tz(zone).expect("zone");
        if matches!(local.hour(), 20 | 23) && local.minute() == 0 {
            for agent in AGENTS_WITH_HISTORY {
                message += 1;
                fleet.engines[0].ingest_slack(dm(agent, message, now)).await.expect("ingest");
            }
        }
        fleet.settle().await;
        // Both instances tick at once, each from its own projection.
        let (first, second) = tokio::join!(fleet.engines[0].memory_tick(now), fleet.engines[1].memory_tick(now));
        let (first, second) = (first.expect("tick"), second.expect("tick"));
        refused += first.refused + second.refused;
        fleet.settle().await;
        max_open = max_open.max(fleet.open_passes());
        for agent in AGENTS_WITH_HISTORY.iter().chain([&AGENT_WITHOUT_HISTORY]) {
            let passes = run_agent(&fleet.engines[1], agent).await;
            finished.entry((*agent).to_owned()).or_default().extend(passes);
        }
        fleet.settle().await;
    }

    let days: BTreeSet<String> =
        ["05", "06", "07", "08", "09", "10", "11"].iter().map(|d| format!("2026-03-{d}")).collect();
    for agent in AGENTS_WITH_HISTORY {
        let passes = &finished[agent];
        let ids: Vec<&str> = passes.iter().map(|(id, _, _)| id.as_str()).collect();
        let expected: Vec<String> = days.iter().map(|d| format!("memory-pass:{agent}:{d}")).collect();
        assert_eq!(ids, expected, "{agent}: one pass per local window-day, in order, none missing or twice");
        for (id, outcome, _) in passes {
            assert_eq!(*outcome, MemoryOutcome::Completed, "{id}: the digests differed");
        }
        // The first day's pass was caught up at 20:00; every later one was requested at a tick
        // after its slot: the first one, unless maxConcurrent = 1 made it wait for the passes
        // of agents with earlier slots (one tick each, at most two here).
        assert!(passes[0].2 > 12 * 60 * MINUTE_NS, "the first pass is a catch-up: {passes:?}");
        for (id, _, delay_ns) in &passes[1..] {
            assert!((0..=90 * MINUTE_NS).contains(delay_ns), "{id} started {delay_ns} ns after its slot");
        }
    }
    assert!(finished[AGENT_WITHOUT_HISTORY].is_empty(), "no history, no pass");
    let state = fleet.engines[0].projection().state();
    assert_eq!(state.memory_gate(AGENT_WITHOUT_HISTORY).last_outcome, None, "no history, no record");
    assert_eq!(max_open, 1, "maxConcurrent = 1 held at every step");
    // Both instances requested the same passes: the fold refused the loser of each race.
    assert!(refused > 0, "both instances ticked against each other");
    drop(state);
    fleet.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_pass_is_queued_only_after_the_running_one_finishes() {
    let zone = "Europe/London";
    let clock = Arc::new(ManualClock::new(local_ns(zone, "2026-10-24T12:00")));
    let fleet = fleet(clock.clone()).await;
    let config = MemoryConfig::new(true, "01:00", 60, 1, zone, &[], 20 * 1024).expect("config");
    fleet.engines[0].sync_memory_config(&config).await.expect("config");
    for agent in AGENTS_WITH_HISTORY {
        let registration = proto::AgentRegistered { agent_id: agent.to_owned(), ..Default::default() };
        fleet.engines[0].register_agent(registration).await.expect("register");
        fleet.engines[0].ingest_slack(dm(agent, 1, clock.now_ns())).await.expect("ingest");
        run_agent(&fleet.engines[0], agent).await;
    }
    // The clocks go back on 2026-10-25 in London; every slot of that day is past by 03:00 BST.
    clock.set(local_ns(zone, "2026-10-25T03:00"));
    let first = fleet.engines[0].memory_tick(clock.now_ns()).await.expect("tick");
    let second = fleet.engines[1].memory_tick(clock.now_ns()).await.expect("tick");
    assert_eq!(first.queued.len() + second.queued.len(), 1, "one pass at a time: {first:?} {second:?}");
    fleet.settle().await;
    let plan = fleet.engines[1].memory_plan(clock.now_ns());
    let waiting = plan.entries.iter().filter(|e| e.status.as_str() == "waiting_for_limit").count();
    assert_eq!(waiting, 2, "{plan:#?}");
    let running = &plan.entries.iter().find(|e| e.status.as_str() == "open").expect("one open").agent;
    let done = run_agent(&fleet.engines[0], running).await;
    assert_eq!(done.len(), 1);
    // The other instance plans from its own fold: let it see the finish first (a tick on a fold
    // that lags only waits for the next tick; the fold judges every request where it lands).
    fleet.settle().await;
    let next = fleet.engines[1].memory_tick(clock.now_ns()).await.expect("tick");
    assert_eq!(next.queued.len(), 1, "the next agent in slot order is queued once the first finished");
    fleet.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn going_back_to_an_earlier_configuration_is_appended_within_the_dedupe_window() {
    let clock = Arc::new(ManualClock::new(local_ns("UTC", "2026-06-01T12:00")));
    let fleet = fleet(clock).await;
    let first = MemoryConfig::new(true, "05:00", 120, 1, "UTC", &[], 20 * 1024).expect("config");
    let second = MemoryConfig::new(true, "05:00", 120, 3, "UTC", &[], 20 * 1024).expect("config");
    for config in [&first, &second, &first] {
        assert!(fleet.engines[0].sync_memory_config(config).await.expect("sync"), "{config:?} differs from the log's");
        assert_eq!(&fleet.engines[0].projection().state().memory_config(), config);
    }
    fleet.shutdown.cancel();
}
