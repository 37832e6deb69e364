//! The memory pass through the binary: the scheduler queues a pass once the agent has history,
//! the runtime claims it like any wake (maintenance or consolidation form by the size it
//! reports), finishes it with digests, and `Memory.Plan` / `Memory.Status` explain where every
//! agent stands. Runtime tokens see only their own agents.

use std::time::Duration;

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

/// Slots at 00:00 UTC every day (a one-minute window puts every agent at offset 0), so today's
/// pass is always due; only ada is in scope; the scheduler ticks every second.
const MEMORY: &str = "tickSeconds = 1\nwindowStart = \"00:00\"\nwindowDurationMinutes = 1\nscopeAgentIds = [\"ada\"]\n";

async fn status(memory: &mut api::memory_client::MemoryClient<Authed>) -> api::MemoryStatusResponse {
    memory.status(api::MemoryStatusRequest { agent_id: "ada".into() }).await.expect("status").into_inner()
}

fn plan_entry<'a>(plan: &'a api::MemoryPlanResponse, agent: &str) -> &'a api::MemoryPlanEntry {
    plan.entries.iter().find(|e| e.agent_id == agent).expect("agent in plan")
}

async fn scenario(backend: Backend) {
    let options = ServerOptions { memory_coherence: Some(MEMORY.into()), ..ServerOptions::default() };
    let server = Server::start_on(backend, options);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut ada_memory = server.memory(ADA_RUNTIME_TOKEN).await;
    let mut operator = server.memory(REPLAY_TOKEN).await;

    // Before any history: nothing to consolidate; bob is not in scope.
    let plan = operator.plan(api::MemoryPlanRequest::default()).await.expect("plan").into_inner();
    assert!(plan.enabled && plan.max_concurrent == 1 && plan.timezone == "UTC", "{plan:?}");
    assert_eq!(plan_entry(&plan, "ada").status, "no_new_history", "{plan:?}");
    assert_eq!(plan_entry(&plan, "bob").status, "out_of_scope", "{plan:?}");

    // A DM gives ada history; its wake runs first.
    ingest.append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "hello")).await.expect("append");
    let dm = claim_and_start(&mut wakes, "ada", "w1", 0).await;
    assert_eq!(dm.reason, "dm");
    wakes
        .finish(api::FinishRequest {
            agent_id: "ada".into(),
            worker_id: "w1".into(),
            item_id: dm.item_id.clone(),
            outcome: api::WakeOutcome::Completed as i32,
            ..Default::default()
        })
        .await
        .expect("finish the dm");

    // The scheduler queues today's pass within a few ticks.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = status(&mut ada_memory).await.now.expect("now");
        if now.status == "open" {
            assert!(now.pass_id.starts_with("memory-pass:ada:"), "{now:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "no pass queued within 30 s: {now:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Claimed like any wake; a large MEMORY.md gets the consolidation form; no reply target.
    let pass = claim_and_start(&mut wakes, "ada", "w1", 30_000).await;
    assert_eq!(pass.reason, "memory");
    assert!(pass.reply_to.is_none(), "{pass:?}");
    assert!(pass.text.contains("form: consolidation"), "{}", pass.text);
    assert!(!pass.text.contains("hello"), "no conversation in a pass:\n{}", pass.text);

    // A completed pass must carry its digests; equal digests are a quiet skip.
    let finish = |before: Vec<u8>, after: Vec<u8>| api::FinishRequest {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        item_id: pass.item_id.clone(),
        outcome: api::WakeOutcome::Completed as i32,
        memory_digest_before: before,
        memory_digest_after: after,
        ..Default::default()
    };
    let refused = wakes.finish(finish(Vec::new(), Vec::new())).await.expect_err("digests are required");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("memory_digest_before"), "{refused:?}");
    let finished = wakes.finish(finish(vec![7; 32], vec![7; 32])).await.expect("finish").into_inner();
    assert_eq!(finished.memory_outcome, "quiet_skipped");

    let after = status(&mut ada_memory).await;
    let last = after.last_outcome.clone().expect("an outcome");
    assert_eq!((last.outcome.as_str(), last.pass_id.as_str()), ("quiet_skipped", pass.item_id.as_str()));
    assert!(last.started_at_ms >= last.slot_at_ms && last.delay_ms >= 0, "{last:?}");
    assert_eq!(after.now.as_ref().expect("now").status, "already_done");
    assert!(after.next_slot_at_ms > last.slot_at_ms, "the next slot is tomorrow's: {after:?}");
    let plan = operator.plan(api::MemoryPlanRequest::default()).await.expect("plan").into_inner();
    assert_eq!(plan_entry(&plan, "ada").status, "already_done", "{plan:?}");
    // Replay shows the gate as of now: the outcome closed it.
    let mut replay = api::replay_client::ReplayClient::with_interceptor(server.channel().await, bearer(REPLAY_TOKEN));
    let state = replay
        .state_at(api::ReplayStateAtRequest { agent_id: "ada".into(), ..Default::default() })
        .await
        .expect("state")
        .into_inner();
    let gate = state.agent.expect("agent").memory_gate;
    assert!(gate.contains("(not eligible)") && gate.contains(&format!("{} quiet_skipped", pass.item_id)), "{gate}");

    // Runtime tokens: own agents' status only; no fleet plan.
    let mut bob_memory = server.memory(BOB_RUNTIME_TOKEN).await;
    let denied = bob_memory.status(api::MemoryStatusRequest { agent_id: "ada".into() }).await.expect_err("not bob's");
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = ada_memory.plan(api::MemoryPlanRequest::default()).await.expect_err("operators only");
    assert_eq!(denied.code(), Code::PermissionDenied);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pass_on_the_embedded_log() {
    scenario(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_pass_on_jetstream() {
    scenario(Backend::JetStream).await;
}
