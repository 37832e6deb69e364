//! The claim lease and the recovery loop, and the Linear response guard, in
//! one engine instance on the embedded log, with a manual clock that stamps the log and drives
//! the loop's "now": a claim never started within its lease is re-queued for any worker and its
//! late start refused; a running wake silent for 30 minutes is re-queued to resume; a heartbeat
//! in time keeps either; a response to a session the agent never received is refused.
//!
//! The loop runs for real. Tests that must not race it give it a period longer than the test
//! (it ticks once at start, when nothing is due); the others give it a short one and wait for its
//! effect with a deadline.

use std::sync::Arc;
use std::time::Duration;

use anima_engine::clock::{Clock, ManualClock};
use anima_engine::command::{CommandError, SlackObservation};
use anima_engine::instance::{Backend, Instance, InstanceConfig};
use anima_engine::log::embedded::EmbeddedConfig;
use anima_engine::Engine;
use anima_projections::proto;
use anima_projections::verdict::{ClaimedWake, RefusalKind};
use anima_projections::wake::PlanEntry;

const MINUTE: Duration = Duration::from_secs(60);
/// 2026-12-01 09:00 UTC.
const START_NS: i64 = 1_796_115_600 * 1_000_000_000;
/// How long a test waits for the loop's effect before it fails.
const LOOP_DEADLINE: Duration = Duration::from_secs(20);

struct Fixture {
    instance: Instance,
    clock: Arc<ManualClock>,
    _dir: tempfile::TempDir,
}

/// An instance whose recovery loop ticks every `recovery_interval` (real time), with agent ada
/// registered and a DM from a person queued for her.
async fn fixture(recovery_interval: Duration) -> Fixture {
    fixture_with_lease(recovery_interval, Duration::from_secs(300)).await
}

/// The same, with the engine's claim lease set to `claim_lease`.
async fn fixture_with_lease(recovery_interval: Duration, claim_lease: Duration) -> Fixture {
    let clock = Arc::new(ManualClock::new(START_NS));
    fixture_with_clocks(recovery_interval, claim_lease, clock.clone(), clock).await
}

/// The same, with one clock stamping the log and another for the instance's "now".
async fn fixture_with_clocks(
    recovery_interval: Duration,
    claim_lease: Duration,
    log_clock: Arc<ManualClock>,
    clock: Arc<ManualClock>,
) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let embedded = EmbeddedConfig { clock: log_clock, ..EmbeddedConfig::default() };
    let mut config = InstanceConfig::new(dir.path(), Backend::Embedded(embedded));
    config.clock = clock.clone();
    config.recovery_interval = recovery_interval;
    config.engine.claim_lease = claim_lease;
    let instance = Instance::start(config).await.expect("instance");
    let engine = &instance.engine;
    engine
        .register_agent(proto::AgentRegistered {
            agent_id: "ada".into(),
            slack_bot_user_id: "UADA".into(),
            slack_bot_id: "BADA".into(),
            ..Default::default()
        })
        .await
        .expect("register");
    engine
        .ingest_slack(SlackObservation {
            receiving_agent_ids: vec!["ada".into()],
            message: proto::SlackMessageObserved {
                kind: proto::SlackDeliveryKind::Message as i32,
                team_id: "T1".into(),
                channel_id: "D1".into(),
                ts: "1796115600.000100".into(),
                user_id: "UPERSON".into(),
                text: "can you look at the deploy?".into(),
                ..Default::default()
            },
            occurred_at_ms: START_NS / 1_000_000,
        })
        .await
        .expect("ingest");
    Fixture { instance, clock, _dir: dir }
}

impl Fixture {
    fn engine(&self) -> &Engine {
        &self.instance.engine
    }

    async fn claim(&self, worker: &str) -> Option<ClaimedWake> {
        let request =
            proto::WakeClaimRequested { agent_id: "ada".into(), worker_id: worker.into(), ..Default::default() };
        self.engine().claim(request, "").await.expect("claim").wake.map(|wake| wake.claimed)
    }

    async fn start(&self, worker: &str, claimed: &ClaimedWake) -> Result<u64, CommandError> {
        let plan = claimed.plan.iter().map(PlanEntry::to_plan_surface).collect();
        let request = proto::WakeStartRequested {
            agent_id: "ada".into(),
            worker_id: worker.into(),
            item_id: claimed.item.id.clone(),
            plan,
        };
        self.engine().start(request, "").await
    }

    async fn heartbeat(&self, worker: &str, claimed: &ClaimedWake) -> bool {
        let request =
            proto::WakeHeartbeat { agent_id: "ada".into(), worker_id: worker.into(), item_id: claimed.item.id.clone() };
        self.engine().heartbeat(request).await.expect("heartbeat")
    }

    /// Ada's active wake as (item, worker, started), if any.
    fn active(&self) -> Option<(String, String, bool)> {
        let state = self.engine().projection().state();
        let active = state.queue("ada")?.active.as_ref()?;
        Some((active.item.id.clone(), active.worker.clone(), active.started_seq.is_some()))
    }

    /// Ada's queued items as (item, resumes after a restart).
    fn queued(&self) -> Vec<(String, bool)> {
        let state = self.engine().projection().state();
        state.queued_items("ada").into_iter().map(|i| (i.id, i.resume_after_restart)).collect()
    }

    /// Waits until ada has nothing active and `item` is queued (the loop re-queued it).
    async fn wait_until_requeued(&self, item: &str) -> Vec<(String, bool)> {
        let deadline = tokio::time::Instant::now() + LOOP_DEADLINE;
        loop {
            let queued = self.queued();
            if self.active().is_none() && queued.iter().any(|(id, _)| id == item) {
                return queued;
            }
            assert!(tokio::time::Instant::now() < deadline, "the recovery loop did not re-queue {item} in time");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn stop(self) {
        self.instance.stop().await.expect("stop");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_never_started_is_requeued_by_the_loop_and_another_worker_claims_it() {
    let fixture = fixture(Duration::from_millis(20)).await;
    let crashed = fixture.claim("crashed-worker").await.expect("a wake to claim");
    // Given the claiming worker died before its start, when the lease (300 s of log time) passes,
    fixture.clock.advance(MINUTE * 5 + Duration::from_secs(1));
    // then the loop re-queues the wake as it was (it never ran: nothing to resume),
    let queued = fixture.wait_until_requeued(&crashed.item.id).await;
    assert_eq!(queued, vec![(crashed.item.id.clone(), false)]);
    // and another worker claims and starts it.
    let claimed = fixture.claim("w2").await.expect("the re-queued wake");
    assert_eq!(claimed.item.id, crashed.item.id);
    fixture.start("w2", &claimed).await.expect("start by the new worker");
    assert_eq!(fixture.active(), Some((crashed.item.id.clone(), "w2".into(), true)));
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_after_the_lease_ran_out_is_refused_as_aborted() {
    let fixture = fixture(Duration::from_secs(3600)).await;
    let claimed = fixture.claim("slow-worker").await.expect("a wake to claim");
    fixture.clock.advance(MINUTE * 6);
    let error = fixture.start("slow-worker", &claimed).await.expect_err("a late start");
    assert_eq!(error.refusal_kind(), Some(RefusalKind::Aborted), "{error}");
    assert!(error.to_string().contains("lease"), "the refusal says why: {error}");
    // The wake is claimable again at once, by anyone.
    assert_eq!(fixture.queued(), vec![(claimed.item.id.clone(), false)]);
    let again = fixture.claim("slow-worker").await.expect("claim again");
    fixture.start("slow-worker", &again).await.expect("a start in time");
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_extends_the_claim_lease() {
    let fixture = fixture(Duration::from_secs(3600)).await;
    let claimed = fixture.claim("w1").await.expect("a wake to claim");
    fixture.clock.advance(MINUTE * 4);
    assert!(fixture.heartbeat("w1", &claimed).await, "the heartbeat was appended");
    fixture.clock.advance(MINUTE * 4);
    assert_eq!(fixture.engine().recover_silent_wakes(fixture.clock.now_ns()).await.expect("recovery tick"), 0);
    fixture.start("w1", &claimed).await.expect("8 minutes after the claim, 4 after the heartbeat");
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_wake_silent_for_thirty_minutes_is_requeued_to_resume() {
    let fixture = fixture(Duration::from_millis(20)).await;
    let claimed = fixture.claim("w1").await.expect("a wake to claim");
    fixture.start("w1", &claimed).await.expect("start");
    fixture.clock.advance(MINUTE * 29);
    assert_eq!(fixture.active(), Some((claimed.item.id.clone(), "w1".into(), true)));
    fixture.clock.advance(MINUTE * 2);
    let queued = fixture.wait_until_requeued(&claimed.item.id).await;
    assert_eq!(queued, vec![(claimed.item.id.clone(), true)], "it resumes after the restart it implies");
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_in_time_keeps_a_running_wake() {
    let fixture = fixture(Duration::from_secs(3600)).await;
    let claimed = fixture.claim("w1").await.expect("a wake to claim");
    fixture.start("w1", &claimed).await.expect("start");
    fixture.clock.advance(MINUTE * 20);
    assert!(fixture.heartbeat("w1", &claimed).await, "the heartbeat was appended");
    fixture.clock.advance(MINUTE * 15);
    // 35 minutes after the start, 15 after the heartbeat: nothing to recover.
    assert_eq!(fixture.engine().recover_silent_wakes(fixture.clock.now_ns()).await.expect("recovery tick"), 0);
    assert_eq!(fixture.active(), Some((claimed.item.id.clone(), "w1".into(), true)));
    // 31 minutes after the heartbeat: recovered.
    fixture.clock.advance(MINUTE * 16);
    assert_eq!(fixture.engine().recover_silent_wakes(fixture.clock.now_ns()).await.expect("recovery tick"), 1);
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_configuration_sets_the_lease_its_claims_carry() {
    let fixture = fixture_with_lease(Duration::from_secs(3600), Duration::from_secs(30)).await;
    let claimed = fixture.claim("w1").await.expect("a wake to claim");
    fixture.clock.advance(Duration::from_secs(31));
    let error = fixture.start("w1", &claimed).await.expect_err("31 s after a claim with a 30 s lease");
    assert_eq!(error.refusal_kind(), Some(RefusalKind::Aborted), "{error}");
    assert!(error.to_string().contains("lease of 30 s"), "{error}");
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_response_to_a_linear_session_the_agent_never_received_is_refused_naming_it() {
    let fixture = fixture(Duration::from_secs(3600)).await;
    let session = "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01";
    let request = proto::LinearResponseRequested {
        agent_id: "ada".into(),
        session_id: session.into(),
        kind: proto::LinearResponseKind::Response as i32,
        body: "posting into a session I was never given".into(),
        input_ids: Vec::new(),
    };
    let error = fixture.engine().respond_linear(request, "").await.expect_err("an unreceived session");
    assert_eq!(error.refusal_kind(), Some(RefusalKind::FailedPrecondition), "{error}");
    assert!(error.to_string().contains(session), "the refusal names the session: {error}");
    fixture.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovery_refused_because_this_clock_runs_ahead_of_the_log_is_asked_again_later() {
    let log_clock = Arc::new(ManualClock::new(START_NS));
    let instance_clock = Arc::new(ManualClock::new(START_NS));
    let fixture =
        fixture_with_clocks(Duration::from_secs(3600), Duration::from_secs(300), log_clock.clone(), instance_clock)
            .await;
    let claimed = fixture.claim("crashed-worker").await.expect("a wake to claim");
    // The instance's clock is 6 minutes ahead of the log's: it asks, and the fold, judging by the
    // log's time, refuses.
    fixture.clock.advance(MINUTE * 6);
    assert_eq!(fixture.engine().recover_silent_wakes(fixture.clock.now_ns()).await.expect("tick"), 0);
    assert_eq!(fixture.active().map(|a| a.0), Some(claimed.item.id.clone()));
    // Once the log's time has passed the lease too, the next tick's request is a new one (not the
    // earlier refusal again, from the log's dedupe window) and the claim is re-queued.
    log_clock.advance(MINUTE * 6);
    fixture.clock.advance(MINUTE);
    assert_eq!(fixture.engine().recover_silent_wakes(fixture.clock.now_ns()).await.expect("tick"), 1);
    assert_eq!(fixture.queued(), vec![(claimed.item.id.clone(), false)]);
    fixture.stop().await;
}
