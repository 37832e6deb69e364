//! Bad input answered well at the engine's edge: a refusal names the field, repeats at most a
//! clipped part of the value (so it never outgrows gRPC's metadata limit and arrives as the
//! refusal it is), and appends nothing. The check of a request's agent reads no fold state, so
//! it answers while the fold holds its lock.

use std::sync::Arc;

use anima_engine::checkpoint::CheckpointStore;
use anima_engine::command::SlackObservation;
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::EventLog;
use anima_engine::validate::{ECHO_BYTES_MAX, MEMORY_DIGEST_BYTES};
use anima_engine::{CommandError, Engine, EngineConfig, Runner, RunnerConfig};
use anima_projections::proto;
use tokio_util::sync::CancellationToken;

/// Longest refusal message expected: the field, the reason and a clipped echo.
const REFUSAL_BYTES_MAX: usize = 4 * ECHO_BYTES_MAX + 200;
/// How long a request may take to be answered before a test gives up on it.
const WAIT: std::time::Duration = std::time::Duration::from_secs(20);
/// Far over every bound: 1 MB.
const HUGE_BYTES: usize = 1_000_000;

struct Fixture {
    engine: Engine,
    shutdown: CancellationToken,
    _dirs: [tempfile::TempDir; 2],
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// One engine on an embedded log, with `ada` registered.
async fn fixture() -> Fixture {
    let log_dir = tempfile::tempdir().expect("tempdir");
    let db = sled::Config::new().path(log_dir.path()).open().expect("sled");
    let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).expect("log"));
    let checkpoint_dir = tempfile::tempdir().expect("tempdir");
    let db = anima_engine::checkpoint::CheckpointDb::open(checkpoint_dir.path(), 16 * 1024 * 1024).expect("store");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("checkpoints");
    let shutdown = CancellationToken::new();
    let runner =
        Runner::start(log.clone(), checkpoints, RunnerConfig::default(), shutdown.clone()).await.expect("runner");
    let engine = Engine::new(log, runner.projection, EngineConfig::default());
    let ada = proto::AgentRegistered { agent_id: "ada".into(), slack_bot_user_id: "UADA".into(), ..Default::default() };
    engine.sync_agents(&[ada]).await.expect("register ada");
    Fixture { engine, shutdown, _dirs: [log_dir, checkpoint_dir] }
}

/// The refusal is INVALID_ARGUMENT for `field`, short, and the log did not grow.
#[track_caller]
fn assert_refused(error: CommandError, field: &str, last_before: u64, last_after: u64) {
    let message = error.to_string();
    match &error {
        CommandError::InvalidArgument { field: named, .. } => assert_eq!(*named, field, "{message}"),
        other => panic!("expected INVALID_ARGUMENT for {field}, got {other:?}"),
    }
    assert!(message.len() <= REFUSAL_BYTES_MAX, "the refusal echoes {} bytes: {:.200}", message.len(), message);
    assert_eq!(last_after, last_before, "a refused request appends nothing");
}

fn finish(digest_before: Vec<u8>, digest_after: Vec<u8>) -> proto::WakeFinishRequested {
    proto::WakeFinishRequested {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        item_id: "memory-pass:ada:2026-12-01".into(),
        outcome: proto::WakeOutcome::Completed as i32,
        memory_digest_before: digest_before,
        memory_digest_after: digest_after,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_digest_that_is_not_32_bytes_is_refused_before_the_log() {
    let fixture = fixture().await;
    let log = fixture.engine.log();
    let digest = vec![7u8; MEMORY_DIGEST_BYTES];
    for (before, after, field) in [
        (vec![0u8; 900 * 1024], digest.clone(), "memory_digest_before"),
        (digest.clone(), vec![1u8; MEMORY_DIGEST_BYTES + 1], "memory_digest_after"),
        (vec![1u8; MEMORY_DIGEST_BYTES - 1], digest.clone(), "memory_digest_before"),
    ] {
        let last_before = log.last_seq().await.expect("last seq");
        let error = fixture.engine.finish(finish(before, after), "").await.expect_err("a bad digest is refused");
        assert_refused(error, field, last_before, log.last_seq().await.expect("last seq"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_repeat_only_a_clipped_part_of_a_huge_value() {
    let fixture = fixture().await;
    let log = fixture.engine.log();
    let huge = "9".repeat(HUGE_BYTES);
    let slack = |thread_ts: &str| proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: "T1".into(),
            channel_id: "C1".into(),
            thread_ts: thread_ts.into(),
        })),
    };

    let last_before = log.last_seq().await.expect("last seq");
    let confirm = proto::SendConfirmed {
        agent_id: "ada".into(),
        target: Some(slack("")),
        kind: proto::SendKind::Message as i32,
        ts: huge.clone(),
        ..Default::default()
    };
    let error = fixture.engine.confirm(confirm, "").await.expect_err("a 1 MB ts is refused");
    assert_refused(error, "ts", last_before, log.last_seq().await.expect("last seq"));

    let confirm = proto::SendConfirmed {
        agent_id: "ada".into(),
        target: Some(slack(&huge)),
        kind: proto::SendKind::Message as i32,
        ts: "1700000000.000100".into(),
        ..Default::default()
    };
    let error = fixture.engine.confirm(confirm, "").await.expect_err("a 1 MB thread_ts is refused");
    assert_refused(error, "target.thread_ts", last_before, log.last_seq().await.expect("last seq"));

    // Unknown agents are named back, clipped (ids up to 128 bytes are well-formed).
    let unknown = "z".repeat(128);
    let confirm = proto::SendConfirmed {
        agent_id: unknown.clone(),
        target: Some(slack("")),
        kind: proto::SendKind::Message as i32,
        ts: "1700000000.000100".into(),
        ..Default::default()
    };
    let error = fixture.engine.confirm(confirm, "").await.expect_err("an unknown agent is refused");
    let message = error.to_string();
    assert!(message.contains(&format!("\"{}\"…", &unknown[..ECHO_BYTES_MAX])), "{message}");
    assert!(!message.contains(&unknown), "{message}");
    assert_refused(error, "agent_id", last_before, log.last_seq().await.expect("last seq"));
}

/// A message from U1 in ada's DM D1, at `ts`, for `agent`.
fn observation(agent: &str, ts: &str) -> SlackObservation {
    SlackObservation {
        receiving_agent_ids: vec![agent.into()],
        message: proto::SlackMessageObserved {
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: "T1".into(),
            channel_id: "D1".into(),
            ts: ts.into(),
            user_id: "U1".into(),
            text: "hello".into(),
            ..Default::default()
        },
        occurred_at_ms: 1_700_000_000_000,
    }
}

/// Holds the state lock on a thread of its own, as the fold holds it through a slow read back
/// from the checkpoint store, and returns once it is held. The holder lets go when told to, or
/// on its own after WAIT (tokio's timers cannot fire while requests block both workers on the
/// lock); joining it says whether it was told to.
fn hold_state_lock(engine: &Engine) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<bool>) {
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let projection = engine.projection().clone();
    let holder = std::thread::spawn(move || {
        let _state = projection.state();
        locked.send(()).expect("the test waits");
        released.recv_timeout(WAIT).is_ok()
    });
    is_locked.recv().expect("the lock is held");
    (release, holder)
}

/// Every ingest and command checks that its agent is registered before it appends. The fold
/// holds the state lock while it reads state back from the checkpoint store (tens of
/// milliseconds when the store is writing), so the check reads no state: an observation for a
/// registered agent reaches the log while the lock is held, and one for an agent nobody
/// registered is still refused before the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_check_before_the_log_does_not_wait_for_the_folds_state() {
    let fixture = fixture().await;
    let log = fixture.engine.log().clone();
    let last_before = log.last_seq().await.expect("last seq");
    // Given the state lock held, as the fold holds it through a slow read,
    let (release, holder) = hold_state_lock(&fixture.engine);
    // when a connector hands in a message for ada (registered) and one for nobody's agent,
    let ingest = |agent: &str, ts: &str| {
        let engine = fixture.engine.clone();
        let message = observation(agent, ts);
        tokio::spawn(async move { engine.ingest_slack(message).await })
    };
    let ingesting = ingest("ada", "1700000000.000100");
    let refusing = ingest("nobody", "1700000000.000200");
    // Then ada's reaches the log with the lock still held (its verdict waits for the fold)
    let reached = tokio::time::timeout(WAIT, async {
        while log.last_seq().await.expect("last seq") == last_before {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await;
    let refused = tokio::time::timeout(WAIT, refusing).await;
    // (The holder may have let go on its own already.)
    let _ = release.send(());
    let held_throughout = holder.join().expect("the holder ends");
    reached.expect("ada's message is appended");
    assert!(held_throughout, "ada's message reached the log only once the fold let go of its state");
    let ingested = ingesting.await.expect("join").expect("ada's message is journaled once the fold goes on");
    assert_eq!(ingested[0].seq, last_before + 1);
    // and the other is refused, naming the agent, with nothing appended for it.
    let refused = refused.expect("the unknown agent is answered while the fold holds its state");
    let error = refused.expect("join").expect_err("an unknown agent is refused");
    assert!(matches!(&error, CommandError::InvalidArgument { field: "receiving_agent_ids", .. }), "{error:?}");
    assert_eq!(log.last_seq().await.expect("last seq"), last_before + 1, "only ada's message is in the log");
}

/// A request whose event the fold has already applied reads its verdict without the state
/// lock: the fold holds that lock through its next batch, and a request waiting for it held a
/// tokio worker too (two such requests stopped every call of a 2-core engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_fold_has_applied_is_answered_while_the_fold_holds_its_state() {
    let fixture = fixture().await;
    let message = observation("ada", "1700000000.000100");
    let first = fixture.engine.ingest_slack(message.clone()).await.expect("ada's message is journaled");
    // Given the state lock held, as the fold holds it through a slow read,
    let (release, holder) = hold_state_lock(&fixture.engine);
    // when the connector retries the message (same content, same event id: the log dedupes it),
    let engine = fixture.engine.clone();
    let retry = tokio::time::timeout(WAIT, tokio::spawn(async move { engine.ingest_slack(message).await })).await;
    let _ = release.send(());
    let held_throughout = holder.join().expect("the holder ends");
    // then it is answered with the lock still held, with the first delivery's verdict.
    assert!(held_throughout, "the retry was answered only once the fold let go of its state");
    let retried = retry.expect("answered in time").expect("join").expect("the retry is answered");
    assert_eq!(retried.len(), 1);
    assert!(retried[0].duplicate_event);
    assert_eq!(retried[0].seq, first[0].seq);
    assert_eq!(retried[0].journal, first[0].journal);
}
