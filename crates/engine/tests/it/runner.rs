//! The projection runner: resuming from a checkpoint gives the same state as a rebuild; a
//! checkpoint from another fold version or another stream is discarded; the fold of the runner
//! equals a fresh fold of the raw log, byte for byte.

use std::sync::Arc;
use std::time::Duration;

use anima_engine::checkpoint::{CheckpointDb, CheckpointError, CheckpointStore, FOLD_VERSION_KEY, STREAM_KEY};
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::{AppendRecord, EventLog};
use anima_engine::{Runner, RunnerConfig};
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::{LogPosition, State};
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(20);

fn envelope(id: String, payload: Payload) -> proto::Envelope {
    proto::Envelope {
        event_id: id,
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".into(),
        payload: Some(payload),
    }
}

/// A registration and `messages` DMs from a person, half of them with a send request after.
fn events(messages: usize, id_prefix: &str) -> Vec<AppendRecord> {
    let mut out = vec![envelope(
        format!("{id_prefix}-agent"),
        Payload::AgentRegistered(proto::AgentRegistered {
            agent_id: "ada".into(),
            slack_bot_user_id: "U0ADA".into(),
            ..Default::default()
        }),
    )];
    for n in 0..messages {
        out.push(envelope(
            format!("{id_prefix}-m{n}"),
            Payload::SlackMessage(proto::SlackMessageObserved {
                receiving_agent_id: "ada".into(),
                kind: proto::SlackDeliveryKind::Message as i32,
                team_id: "T1".into(),
                channel_id: format!("D{}", n % 7),
                ts: format!("{}.000100", 1_700_000_000 + n),
                user_id: "U1".into(),
                text: format!("message {n}"),
                ..Default::default()
            }),
        ));
        if n % 2 == 0 {
            out.push(envelope(
                format!("{id_prefix}-s{n}"),
                Payload::Send(proto::SendRequested {
                    agent_id: "ada".into(),
                    target: Some(proto::ReplyTarget {
                        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
                            team_id: "T1".into(),
                            channel_id: format!("D{}", n % 7),
                            thread_ts: String::new(),
                        })),
                    }),
                    kind: proto::SendKind::Message as i32,
                    draft_bytes: 10,
                    mentioned_user_ids: Vec::new(),
                }),
            ));
        }
    }
    out.into_iter()
        .map(|e| AppendRecord {
            subject: "anima.v1.agent.ada".into(),
            msg_id: e.event_id.clone(),
            payload: Bytes::from(e.encode_to_vec()),
        })
        .collect()
}

fn config() -> RunnerConfig {
    RunnerConfig {
        checkpoint_every_events: 100,
        checkpoint_interval: Duration::from_millis(50),
        ..RunnerConfig::default()
    }
}

async fn run_to_end(log: Arc<dyn EventLog>, checkpoints: CheckpointStore) -> (Vec<u8>, u64) {
    let shutdown = CancellationToken::new();
    let runner = Runner::start(log.clone(), checkpoints, config(), shutdown.clone()).await.expect("runner");
    let restored_at = runner.restored_seq;
    runner.projection.wait_applied(log.last_seq().await.expect("last"), WAIT).await.expect("caught up");
    let bytes = runner.projection.state().canonical_bytes();
    shutdown.cancel();
    runner.task.await.expect("join").expect("runner ends cleanly");
    (bytes, restored_at)
}

/// The fold of the raw log from the start, without the runner.
async fn fresh_fold(log: &Arc<dyn EventLog>) -> Vec<u8> {
    let mut state = State::new();
    let last = log.last_seq().await.expect("last");
    let mut records = log.read(1, last, None).await.expect("read");
    while let Some(record) = records.next().await {
        let record = record.expect("record");
        state.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
    }
    state.canonical_bytes()
}

/// The error a runner stopped with on its own (a failed or torn checkpoint write).
async fn stops_on_its_own(runner: Runner) -> anima_engine::projection::RunnerError {
    let ended = tokio::time::timeout(WAIT, runner.task).await.expect("the runner stops on its own").expect("join");
    ended.expect_err("the runner reports why it stopped")
}

/// The embedded log of the data dir `dir` and its checkpoint store.
fn open(dir: &std::path::Path) -> (Arc<dyn EventLog>, CheckpointDb) {
    let db = sled::open(dir).expect("sled");
    let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).expect("log"));
    (log, CheckpointDb::open(dir, 16 * 1024 * 1024).expect("checkpoint store"))
}

/// The checkpoint store of `db`, restored as a runner's start restores it (taking its epoch).
async fn restored_store(db: &CheckpointDb, identity: &str) -> CheckpointStore {
    let store = CheckpointStore::open(db, "checkpoint").expect("store");
    store.restore(identity).await.expect("restore");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumes_from_its_checkpoint_with_the_state_a_rebuild_gives() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    log.append_batch(events(300, "a")).await.expect("append");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let (first, restored_at) = run_to_end(log.clone(), checkpoints.clone()).await;
    assert_eq!(restored_at, 0);
    assert_eq!(first, fresh_fold(&log).await, "the runner's fold equals a fresh fold of the raw log");

    // More events while stopped; the next start resumes from the checkpoint, not from zero.
    let checkpointed = checkpoints.checkpointed_seq().expect("seq");
    assert_eq!(checkpointed, 451, "the last checkpoint on shutdown covers every applied event");
    log.append_batch(events(40, "b")).await.expect("append");
    let (resumed, restored_at) = run_to_end(log.clone(), checkpoints).await;
    assert_eq!(restored_at, checkpointed);
    assert_eq!(resumed, fresh_fold(&log).await, "resumed state is byte-identical to a rebuild");
    drop(db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discards_a_checkpoint_of_another_fold_version_or_stream() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    log.append_batch(events(50, "a")).await.expect("append");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let (expected, _) = run_to_end(log.clone(), checkpoints.clone()).await;

    // Another fold version wrote it: rebuilt from seq 0, same result.
    let tree = checkpoints.stored().clone();
    tree.insert(FOLD_VERSION_KEY, &999u32.to_be_bytes()[..]).expect("insert");
    let (rebuilt, restored_at) = run_to_end(log.clone(), checkpoints.clone()).await;
    assert_eq!(restored_at, 0, "a checkpoint of another fold version is not used");
    assert_eq!(rebuilt, expected);

    // Another stream: the checkpoint says a different identity.
    tree.insert(STREAM_KEY, b"some-other-stream".as_slice()).expect("insert");
    let (rebuilt, restored_at) = run_to_end(log.clone(), checkpoints.clone()).await;
    assert_eq!(restored_at, 0, "a checkpoint of another stream is not used");
    assert_eq!(rebuilt, expected);

    // An entry that does not decode, the last hot one (the restore has loaded all the others
    // into its state by then): rebuilt from seq 0, same result.
    let (_, restored_at) = run_to_end(log.clone(), checkpoints.clone()).await;
    assert!(restored_at > 0, "the checkpoint the rebuild wrote is used");
    let last_hot = tree
        .prefix([anima_engine::checkpoint::STATE_PREFIX])
        .rev()
        .map(|entry| entry.key().expect("key"))
        .find(|key| !State::is_cold_tag(key[1]))
        .expect("a hot entry");
    tree.insert(last_hot, &[0xff; 16][..]).expect("insert");
    let (rebuilt, restored_at) = run_to_end(log.clone(), checkpoints.clone()).await;
    assert_eq!(restored_at, 0, "a checkpoint with an entry that does not decode is not used");
    assert_eq!(rebuilt, expected);

    // Untouched, it is used.
    let (resumed, restored_at) = run_to_end(log, checkpoints).await;
    assert!(restored_at > 0);
    assert_eq!(resumed, expected);
}

/// A runner that cannot write its checkpoint stops and says why: a request waiting for its
/// verdict is answered at once with the cause instead of waiting out its timeout, and the
/// runner's task ends with the error (what the gateway's supervision acts on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_checkpoint_write_stops_the_runner_and_waiters_learn_why() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let shutdown = CancellationToken::new();
    let runner = Runner::start(log.clone(), checkpoints.clone(), config(), shutdown.clone()).await.expect("runner");
    log.append_batch(events(10, "a")).await.expect("append");
    let last = log.last_seq().await.expect("last");
    runner.projection.wait_applied(last, WAIT).await.expect("caught up");

    checkpoints.inject_write_failure();
    log.append_batch(events(200, "b")).await.expect("append");
    let projection = runner.projection.clone();
    let error = stops_on_its_own(runner).await;
    assert!(error.to_string().contains("injected checkpoint write failure"), "{error}");

    let far = log.last_seq().await.expect("last") + 1_000;
    let waited = tokio::time::Instant::now();
    let answer = projection.wait_applied(far, Duration::from_secs(600)).await.expect_err("never applied");
    assert!(waited.elapsed() < Duration::from_secs(60), "answered at once, not after the 600 s timeout");
    assert!(answer.to_string().contains("checkpoint"), "{answer}");
    assert_eq!(projection.stop_cause().as_deref(), Some(error.to_string().as_str()));
    drop(db);
}

/// A crash in the middle of writing a checkpoint (the end of its write batch never reached the
/// disk) leaves the checkpoint before it, whole: the next start resumes from that one, not from
/// the torn one and not from zero, and reaches the state a fresh fold of the log gives. The
/// crash is made on disk: the checkpoint store's journal is cut inside its last batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_torn_by_a_crash_leaves_the_one_before_it_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    log.append_batch(events(300, "a")).await.expect("append");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    run_to_end(log.clone(), checkpoints.clone()).await;
    let whole = checkpoints.checkpointed_seq().expect("seq");
    // The next run's checkpoints, the last of them written when it stops.
    log.append_batch(events(200, "b")).await.expect("append");
    run_to_end(log.clone(), checkpoints.clone()).await;
    let last = checkpoints.checkpointed_seq().expect("seq");
    assert!(last > whole, "{last} after {whole}");
    // The store lets go of its files when its last handle is dropped.
    drop((checkpoints, db));

    // The crash: the newest journal loses the last bytes of its last batch. (A journal file is
    // made long before it is written: what follows its last batch is zeros.)
    let journal = newest_journal(dir.path());
    let bytes = std::fs::read(&journal).expect("journal");
    let end = bytes.iter().rposition(|&b| b != 0).expect("a written journal") + 1;
    std::fs::OpenOptions::new().write(true).open(&journal).expect("journal").set_len(end as u64 - 5).expect("cut");

    let db = CheckpointDb::open(dir.path(), 16 * 1024 * 1024).expect("reopen");
    let after = CheckpointStore::open(&db, "checkpoint").expect("store");
    let restored = after.checkpointed_seq().expect("seq");
    assert!(restored < last, "the torn checkpoint ({last}) is gone whole: restored {restored}");
    assert!(restored >= whole, "the ones before it are kept: restored {restored}, {whole} was written before");
    let (resumed, restored_at) = run_to_end(log.clone(), after).await;
    assert_eq!(restored_at, restored);
    assert_eq!(resumed, fresh_fold(&log).await, "the checkpoint restored is exact");
}

/// The checkpoint store's journal file written last (the highest-numbered `N.jnl` under it).
fn newest_journal(data_dir: &std::path::Path) -> std::path::PathBuf {
    fn walk(dir: &std::path::Path, found: &mut Vec<(u64, std::path::PathBuf)>) {
        for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, found);
            } else if let Some(n) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".jnl")) {
                found.push((n.parse().expect("a journal number"), path));
            }
        }
    }
    let mut found = Vec::new();
    walk(&data_dir.join(anima_engine::checkpoint::CHECKPOINT_DIR), &mut found);
    found.into_iter().max().expect("a journal").1
}

/// A runner that was replaced cannot write over its successor: once another runner restored the
/// checkpoint, the old one's write is refused (and applies nothing), so a checkpoint is never a
/// mix of two runners — e.g. a runner aborted while its write still waited on the checkpoint thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_runner_cannot_write_over_its_successor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let identity = log.identity();
    let old = restored_store(&db, &identity).await;
    old.write(&identity, vec![], vec![], true).await.expect("the owner writes");
    let new = restored_store(&db, &identity).await;
    let seq_before = new.checkpointed_seq().expect("seq");
    let refused = old.write(&identity, vec![(vec![0], Some(vec![1, 2, 3]))], vec![], true).await;
    assert!(matches!(refused, Err(CheckpointError::Superseded { .. })), "{refused:?}");
    assert_eq!(new.checkpointed_seq().expect("seq"), seq_before, "the stale write applied nothing");
    new.write(&identity, vec![], vec![], true).await.expect("the successor writes");
    drop(db);
}

/// A fleet's traffic: `agents` agents with 40 DMs each and shared channels, messages from
/// people (some mentioning an agent), sends into surfaces that moved, and wakes claimed, started
/// with the plan their claim handed out, and finished. Requests are built from a shadow fold of
/// what was generated so far, so starts carry real plans and cursors move.
fn fleet_events(agents: usize, total: usize, seed: u64) -> Vec<AppendRecord> {
    use anima_projections::verdict::{ClaimVerdict, Verdict};
    let mut random = seed;
    let mut next = move |n: u64| {
        random = random.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (random >> 33) % n
    };
    let slack = |channel: String| proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: "T1".into(),
            channel_id: channel,
            thread_ts: String::new(),
        })),
    };
    let mut shadow = State::new();
    let mut out: Vec<AppendRecord> = Vec::new();
    let mut emit = |payload: Payload, shadow: &mut State| {
        let e = envelope(format!("fleet-{seed}-{}", out.len()), payload);
        let at =
            LogPosition { seq: out.len() as u64 + 1, at_ns: 1_700_000_000_000_000_000 + out.len() as i64 * 1_000_000 };
        shadow.apply(at, &e);
        out.push(AppendRecord {
            subject: "anima.v1.fleet".into(),
            msg_id: e.event_id.clone(),
            payload: Bytes::from(e.encode_to_vec()),
        });
        shadow.verdict(at.seq).cloned()
    };
    for a in 0..agents {
        let registration = proto::AgentRegistered {
            agent_id: format!("a{a}"),
            slack_bot_user_id: format!("UB{a}"),
            ..Default::default()
        };
        emit(Payload::AgentRegistered(registration), &mut shadow);
    }
    // Per agent: the claimed wake waiting for its start, or the started one waiting to finish.
    let mut wakes: Vec<Option<(String, Vec<proto::PlanSurface>, bool)>> = vec![None; agents];
    let mut messages = 0u64;
    for _ in 0..total {
        let agent = next(agents as u64) as usize;
        let agent_id = format!("a{agent}");
        let channel = if next(3) == 0 { format!("C{}", next(20)) } else { format!("D{agent:03}{:03}", next(40)) };
        match next(10) {
            0..=4 => {
                messages += 1;
                let kind =
                    if next(4) == 0 { proto::SlackDeliveryKind::AppMention } else { proto::SlackDeliveryKind::Message };
                let message = proto::SlackMessageObserved {
                    receiving_agent_id: agent_id,
                    kind: kind as i32,
                    team_id: "T1".into(),
                    channel_id: channel,
                    ts: format!("{}.{:06}", 1_700_000_000 + messages, next(1_000_000)),
                    user_id: format!("U{}", next(30)),
                    text: format!("message {messages}"),
                    ..Default::default()
                };
                emit(Payload::SlackMessage(message), &mut shadow);
            }
            5..=6 => {
                let send = proto::SendRequested {
                    agent_id,
                    target: Some(slack(channel)),
                    kind: proto::SendKind::Message as i32,
                    draft_bytes: 10,
                    mentioned_user_ids: Vec::new(),
                };
                emit(Payload::Send(send), &mut shadow);
            }
            _ => match wakes[agent].take() {
                None => {
                    let claim = proto::WakeClaimRequested { agent_id, worker_id: "w".into(), ..Default::default() };
                    if let Some(Verdict::Claim(ClaimVerdict::Claimed(claimed))) =
                        emit(Payload::WakeClaim(claim), &mut shadow)
                    {
                        let plan = claimed.plan.iter().map(|p| p.to_plan_surface()).collect();
                        wakes[agent] = Some((claimed.item.id.clone(), plan, false));
                    }
                }
                Some((item_id, plan, false)) => {
                    let start = proto::WakeStartRequested {
                        agent_id,
                        worker_id: "w".into(),
                        item_id: item_id.clone(),
                        plan: plan.clone(),
                    };
                    emit(Payload::WakeStart(start), &mut shadow);
                    wakes[agent] = Some((item_id, plan, true));
                }
                Some((item_id, _, true)) => {
                    let finish = proto::WakeFinishRequested {
                        agent_id,
                        worker_id: "w".into(),
                        item_id,
                        outcome: proto::WakeOutcome::Completed as i32,
                        ..Default::default()
                    };
                    emit(Payload::WakeFinish(finish), &mut shadow);
                }
            },
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verdicts_and_state_do_not_depend_on_the_memory_budget() {
    // The runner with a zero budget lets every clean journal row and identity leave memory after
    // each checkpoint and reads them back from the checkpoint store when a decision needs them
    // (the engine counts those reads for its metrics); a fold with
    // everything in memory must reach the same verdicts and the same state.
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let records = fleet_events(12, 6_000, 7);
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let tiny = RunnerConfig { checkpoint_every_events: 25, state_bytes_max: 0, ..config() };
    let shutdown = CancellationToken::new();
    let runner = Runner::start(log.clone(), checkpoints.clone(), tiny.clone(), shutdown.clone()).await.expect("runner");
    // Appended in slices, so batches, checkpoints and evictions interleave with the traffic.
    for slice in records.chunks(97) {
        let appended = log.append_batch(slice.to_vec()).await.expect("append");
        let last = appended.last().map(|a| a.seq()).unwrap_or(0);
        runner.projection.wait_applied(last, WAIT).await.expect("applied");
    }
    let last = log.last_seq().await.expect("last");
    let reference = raw_fold(&log).await;
    {
        let live = runner.projection.state();
        assert!(
            live.cold_resident_len() * 4 < reference.cold_resident_len(),
            "the zero budget kept {} of {} cold entries in memory",
            live.cold_resident_len(),
            reference.cold_resident_len()
        );
        let held = (1..=last)
            .filter(|seq| {
                matches!(
                    reference.verdict(*seq),
                    Some(anima_projections::verdict::Verdict::Send(anima_projections::verdict::SendVerdict::Held(_)))
                )
            })
            .count();
        assert!(held > 100, "the fleet log holds sends ({held}), so rows are read back");
        let (reads, entries, seconds) = runner.projection.cold_reads();
        assert!(
            reads > 0 && entries > 0 && seconds > 0.0,
            "cold reads counted: {reads}, {entries} entries, {seconds} s"
        );
        assert_same_fold(&live, &reference, last);
    }
    shutdown.cancel();
    runner.task.await.expect("join").expect("runner ends cleanly");
    // A restart loads what is hot and leaves the cold entries in the checkpoint: same state.
    let (restarted, restored_at) = run_to_end(log.clone(), checkpoints).await;
    assert_eq!(restored_at, last);
    assert!(restarted == reference.canonical_bytes(), "the restarted state differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_over_its_memory_budget_lowers_the_state_share_and_lets_state_go() {
    // The state's share is twice what the fold of this log takes, so by its share alone nothing
    // leaves memory. A whole-process budget that any process is over (1 MiB) lowers the share to
    // its least, a quarter of it, below what the state takes: the runner lets cold entries go,
    // and the share it reports (the `anima_state_budget_bytes` gauge) says so. Verdicts and
    // state stay those of the fold with everything in memory.
    let records = fleet_events(12, 6_000, 11);
    let mut sizing = State::new();
    for (n, record) in records.iter().enumerate() {
        sizing.apply_bytes(LogPosition { seq: n as u64 + 1, at_ns: 0 }, &record.payload);
    }
    let share = sizing.memory_estimate_bytes() * 2;
    let mut resident = Vec::new();
    for process_bytes_max in [0, 1024 * 1024] {
        let dir = tempfile::tempdir().expect("tempdir");
        let (log, db) = open(dir.path());
        let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
        let budgeted = RunnerConfig { state_bytes_max: share, process_bytes_max, ..config() };
        let shutdown = CancellationToken::new();
        let runner = Runner::start(log.clone(), checkpoints.clone(), budgeted, shutdown.clone()).await.expect("runner");
        for slice in records.chunks(97) {
            let appended = log.append_batch(slice.to_vec()).await.expect("append");
            let last = appended.last().map(|a| a.seq()).unwrap_or(0);
            runner.projection.wait_applied(last, WAIT).await.expect("applied");
        }
        let (_, reported) = runner.projection.state_memory_bytes();
        let expected = if process_bytes_max == 0 { share } else { share / 4 };
        assert_eq!(reported as usize, expected, "the share reported with a process budget of {process_bytes_max}");
        let reference = raw_fold(&log).await;
        {
            let live = runner.projection.state();
            resident.push((live.cold_resident_len(), reference.cold_resident_len()));
            assert_same_fold(&live, &reference, log.last_seq().await.expect("last"));
        }
        shutdown.cancel();
        runner.task.await.expect("join").expect("runner ends cleanly");
    }
    assert_eq!(resident[0].0, resident[0].1, "within its share the state keeps every cold entry");
    assert!(
        resident[1].0 < resident[1].1,
        "over the process budget cold entries left memory: {} of {} kept",
        resident[1].0,
        resident[1].1
    );
}

/// The fold of the whole log from the start, with everything in memory.
async fn raw_fold(log: &Arc<dyn EventLog>) -> State {
    let mut state = State::new();
    let mut all = log.read(1, log.last_seq().await.expect("last"), None).await.expect("read");
    while let Some(record) = all.next().await {
        let record = record.expect("record");
        state.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
    }
    state
}

/// The runner's state reached the verdicts of every seq up to `last`, and the state, of `reference`.
fn assert_same_fold(live: &State, reference: &State, last: u64) {
    for seq in 1..=last {
        assert_eq!(live.verdict(seq), reference.verdict(seq), "the verdict of seq {seq} depends on memory");
    }
    assert!(live.canonical_bytes() == reference.canonical_bytes(), "the state depends on memory");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_leaves_queued_wakes_in_the_checkpoint_until_the_fold_needs_them() {
    // A restore loads the queues' headers only; an agent's queued wakes come into memory when
    // the fold first touches its queue, and kept verdicts are decoded when first read. Readers
    // see the queues through the store meanwhile, and every verdict and the final state equal a
    // fold with everything in memory.
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let records = fleet_events(12, 6_000, 11);
    let (before, after) = records.split_at(3_000);
    log.append_batch(before.to_vec()).await.expect("append");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let (_, _) = run_to_end(log.clone(), checkpoints.clone()).await;
    let restart_at = log.last_seq().await.expect("last");
    let mut reference = State::new();
    let mut all = log.read(1, restart_at, None).await.expect("read");
    while let Some(record) = all.next().await {
        let record = record.expect("record");
        reference.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
    }

    let shutdown = CancellationToken::new();
    let runner = Runner::start(log.clone(), checkpoints, config(), shutdown.clone()).await.expect("runner");
    assert_eq!(runner.restored_seq, restart_at, "restored from the checkpoint");
    let agents: Vec<String> = reference.agents.iter().map(|(agent, _)| agent.clone()).collect();
    {
        let restored = runner.projection.state();
        let left_in_store: Vec<&String> =
            agents.iter().filter(|a| restored.queue(a).is_some_and(|q| q.items_in_store())).collect();
        assert!(!left_in_store.is_empty(), "the log leaves queued wakes and the restore loaded none of them");
        for agent in &agents {
            let expected: Vec<String> = reference.queued_items(agent).into_iter().map(|i| i.id).collect();
            let seen: Vec<String> = restored.queued_items(agent).into_iter().map(|i| i.id).collect();
            assert_eq!(seen, expected, "{agent}'s queue as a reader sees it before the fold needs it");
            assert_eq!(
                restored.queue(agent).map(|q| q.queued_len()),
                reference.queue(agent).map(|q| q.queued_len()),
                "{agent}'s queue length from its header"
            );
        }
        assert!(restored.canonical_bytes() == reference.canonical_bytes(), "the restored state differs");
    }
    for slice in after.chunks(97) {
        let appended = log.append_batch(slice.to_vec()).await.expect("append");
        let last = appended.last().map(|a| a.seq()).unwrap_or(0);
        runner.projection.wait_applied(last, WAIT).await.expect("applied");
    }
    let last = log.last_seq().await.expect("last");
    let mut rest = log.read(restart_at + 1, last, None).await.expect("read");
    while let Some(record) = rest.next().await {
        let record = record.expect("record");
        reference.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
    }
    {
        let live = runner.projection.state();
        // Before the restart too: the kept verdicts a restore left in their bytes read the same.
        for seq in 1..=last {
            assert_eq!(live.verdict(seq), reference.verdict(seq), "the verdict of seq {seq}");
        }
        assert!(
            agents.iter().all(|a| live.queue(a).is_none_or(|q| !q.items_in_store())),
            "every agent's queue was touched after the restart, so its items came into memory"
        );
        assert!(live.canonical_bytes() == reference.canonical_bytes(), "the state after the restart differs");
    }
    shutdown.cancel();
    runner.task.await.expect("join").expect("runner ends cleanly");
}

/// The checkpoint store packs the entries of the (owner, slot) tables into slot pages and gives
/// every entry back as it was written: read one by one and scanned by table or owner, through
/// two checkpoints that overwrite and remove entries, in the store's key order. The tree holds
/// far fewer entries than the state wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_pages_give_back_every_entry_the_state_wrote() {
    use anima_projections::cold::ColdStore;
    use anima_projections::slot_page::paged_key;
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let identity = log.identity();
    let store = restored_store(&db, &identity).await;
    // Journal rows (tag 26: interned surface, varint slot) and queued items (tag 27: agent id,
    // big-endian slot) are paged; subscriptions (tag 11) are stored as themselves.
    let row = |surface: u32, slot: u64| [vec![26], postcard::to_stdvec(&(surface, slot)).unwrap()].concat();
    let item = |agent: &str, slot: u64| [vec![27], postcard::to_stdvec(&(agent, slot.to_be_bytes())).unwrap()].concat();
    let other = |n: u32| [vec![11], postcard::to_stdvec(&n).unwrap()].concat();
    assert!(paged_key(&row(1, 1)).is_some() && paged_key(&item("a", 1)).is_some() && paged_key(&other(1)).is_none());
    let mut model = BTreeMap::<Vec<u8>, Vec<u8>>::new();
    let mut first = Vec::new();
    for slot in 0..300u64 {
        for key in [row(1, slot), row(200, slot), item("ada", slot), item("bo", slot * 3)] {
            let value = format!("{slot}:{}", key.len()).into_bytes();
            model.insert(key.clone(), value.clone());
            first.push((key, Some(value)));
        }
    }
    for n in 0..50 {
        model.insert(other(n), vec![n as u8]);
        first.push((other(n), Some(vec![n as u8])));
    }
    store.write(&identity, first, vec![], true).await.expect("first checkpoint");
    let mut second = Vec::new();
    for slot in (0..300u64).step_by(7) {
        model.remove(&row(1, slot));
        second.push((row(1, slot), None));
        model.insert(item("ada", slot), b"requeued".to_vec());
        second.push((item("ada", slot), Some(b"requeued".to_vec())));
    }
    for slot in 0..64u64 {
        model.remove(&row(200, slot));
        second.push((row(200, slot), None));
    }
    store.write(&identity, second, vec![], true).await.expect("second checkpoint");

    let cold = anima_engine::checkpoint::StoredCold::new(&store, Default::default());
    for (key, value) in &model {
        assert_eq!(cold.get(key).expect("get").as_ref(), Some(value), "{key:?}");
    }
    for absent in [row(1, 0), row(200, 10), row(3, 5), item("ada", 9_999), other(77)] {
        assert_eq!(cold.get(&absent).expect("get"), None, "{absent:?}");
    }
    // One read of a key's page gives every entry written in the page, removed or not-written
    // ones left out; a key stored as itself gives its own entry.
    for key in [row(1, 0), row(1, 9), row(200, 64), row(200, 3), item("ada", 7), item("bo", 30), other(3), other(77)] {
        let page = paged_key(&key).map(|paged| paged.page_key);
        let expected: Vec<_> = model
            .iter()
            .filter(|(k, _)| match &page {
                Some(page) => paged_key(k).is_some_and(|other| &other.page_key == page),
                None => **k == key,
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let read = cold.get_page(&key).expect("get_page");
        assert!(read == expected, "the page of {key:?}: {read:?} against {expected:?}");
    }
    assert!(!cold.get_page(&row(1, 1)).expect("get_page").is_empty() && cold.get_page(&row(3, 5)).unwrap().is_empty());
    let prefixes = [
        vec![26],
        [vec![26], postcard::to_stdvec(&1u32).unwrap()].concat(),
        [vec![26], postcard::to_stdvec(&200u32).unwrap()].concat(),
        [vec![27], postcard::to_stdvec(&"ada").unwrap()].concat(),
        vec![27],
        vec![11],
        vec![],
    ];
    for prefix in prefixes {
        let expected: Vec<_> =
            model.iter().filter(|(k, _)| k.starts_with(&prefix)).map(|(k, v)| (k.clone(), v.clone())).collect();
        let scanned = cold.scan(&prefix).expect("scan");
        assert_eq!(scanned.len(), expected.len(), "{prefix:?}");
        assert!(scanned == expected, "the scan of {prefix:?} gives back the entries written, in key order");
    }
    let stored = store.stored().len().expect("len");
    // Pages of 4 slots: the 1,093 paged entries take 434 pages here (bo's slots are 3 apart).
    assert!(stored * 2 < model.len(), "{stored} stored entries for {} state entries", model.len());
    drop(db);
}

/// `len` bytes that do not compress (fjall compresses large values in its journal), from the
/// seed `n`.
fn noise(n: u8, len: usize) -> Vec<u8> {
    let mut random = anima_engine::testing::SeededRng(u64::from(n));
    (0..len.div_ceil(8)).flat_map(|_| random.next_u64().to_le_bytes()).take(len).collect()
}

/// A start whose checkpoint store read a long journal at its open (12 MiB: what a crash leaves,
/// since a stop replaces it) replaces that journal while it runs, before any stop, so that
/// another crash does not make the next start read it again; the fold and the entries of the
/// journal are unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_after_a_crash_replaces_the_long_journal_it_read() {
    const MIB: usize = 1024 * 1024;
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    log.append_batch(events(100, "a")).await.expect("append");
    // Another checkpoint in the same store writes 12 MiB; no stop's write-out follows.
    let other = CheckpointStore::open(&db, "checkpoint-other").expect("store");
    for n in 0..12u8 {
        other.write("other", vec![(vec![11, n], Some(noise(n, MIB)))], vec![], n == 11).await.expect("write");
    }
    drop((other, db));
    let long = newest_journal(dir.path());

    let db = CheckpointDb::open(dir.path(), 16 * 1024 * 1024).expect("reopen");
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let shutdown = CancellationToken::new();
    let runner = Runner::start(log.clone(), checkpoints, config(), shutdown.clone()).await.expect("runner");
    wait_deleted(&long, "the journal the start read is replaced while it runs").await;
    catch_up_and_stop(runner, &log, shutdown).await;
    assert_noise_written(&db.existing("checkpoint-other").expect("read").expect("the other checkpoint"));
}

/// Waits until `journal` is deleted (fjall deletes a journal it replaced); `what` says why it
/// should be.
async fn wait_deleted(journal: &std::path::Path, what: &str) {
    let waited = std::time::Instant::now();
    while journal.exists() {
        assert!(waited.elapsed() < WAIT, "{what} ({})", journal.display());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Lets the runner fold the whole log, checks its state against a fresh fold of the log, and
/// stops it.
async fn catch_up_and_stop(runner: Runner, log: &Arc<dyn EventLog>, shutdown: CancellationToken) {
    runner.projection.wait_applied(log.last_seq().await.expect("last"), WAIT).await.expect("caught up");
    assert_eq!(runner.projection.state().canonical_bytes(), fresh_fold(log).await);
    shutdown.cancel();
    runner.task.await.expect("join").expect("runner ends cleanly");
}

/// The twelve 1 MiB entries the journal tests write into another checkpoint read back as
/// written.
fn assert_noise_written(other: &fjall::Keyspace) {
    for n in 0..12u8 {
        let value = other.get([b's', 11, n]).expect("get").unwrap_or_else(|| panic!("entry {n}"));
        assert!(*value == *noise(n, 1024 * 1024), "entry {n} as written");
    }
}

/// A runner whose store's journal grew long in a busy spell (12 MiB of checkpoints) replaces it
/// once no event has come for its quiet time, without a stop: a crash then leaves a short
/// journal for the next open. A runner that keeps folding does not, and the quiet spell's
/// write-out changes neither the fold nor the entries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_runner_replaces_a_long_journal_before_any_stop() {
    const MIB: usize = 1024 * 1024;
    let dir = tempfile::tempdir().expect("tempdir");
    let (log, db) = open(dir.path());
    let checkpoints = CheckpointStore::open(&db, "checkpoint").expect("store");
    let shutdown = CancellationToken::new();
    // Long beside the gaps between the busy spell's events (well under a second even on a slow
    // machine), so that only the spell after them counts as quiet.
    let quiet = Duration::from_secs(3);
    let config = RunnerConfig { idle_write_out_after: quiet, ..config() };
    let runner = Runner::start(log.clone(), checkpoints, config, shutdown.clone()).await.expect("runner");
    // The busy spell: another checkpoint of the store writes 12 MiB while events keep coming
    // more often than the quiet time.
    let other = CheckpointStore::open(&db, "checkpoint-other").expect("store");
    for n in 0..12u8 {
        other.write("other", vec![(vec![11, n], Some(noise(n, MIB)))], vec![], n == 11).await.expect("write");
        log.append_batch(events(10, &format!("busy-{n}"))).await.expect("append");
    }
    let long = newest_journal(dir.path());
    for n in 0..4 {
        tokio::time::sleep(quiet / 6).await;
        log.append_batch(events(10, &format!("still-busy-{n}"))).await.expect("append");
        assert!(long.exists(), "a runner that keeps folding left its journal ({}) alone", long.display());
    }
    wait_deleted(&long, "the long journal is replaced in the quiet spell").await;
    catch_up_and_stop(runner, &log, shutdown).await;
    assert_noise_written(other.stored());
}
