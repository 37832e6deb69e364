//! Rebuild of all projections from a long log, on both backends, next to a raw read of the same
//! log in the same run; and restart from a checkpoint next to that full rebuild.
//!
//! The log holds `REBUILD_EVENTS` events (default 1,000,000; `--test` 20,000) of the realistic mix
//! of [`anima_benches::mix::generate`], each stored on the subject the engine would store it on, with its
//! event id as msg id, appended in pipelined batches of [`APPEND_BATCH_RECORDS`]. Then, after one
//! untimed raw read, in [`REBUILD_ROUNDS`] rounds of two reads back to back and two folds back to
//! back, each pair in alternating order (reads slow down after a rebuild has written its
//! checkpoints to the same sled database, so the two reads must see the same store):
//!
//! * raw read — the store read directly: the embedded log's sled records scanned in key order, or
//!   JetStream's stream by a raw async-nats ordered push consumer (the reader the log uses), the
//!   payload bytes touched;
//! * log read — `EventLog::read` of the whole log, drained (what the rebuilds read through);
//! * fold — `Replayer::rebuild` of the newest state, as the replay tool rebuilds: the log read
//!   and `State::apply_bytes` of every event, nothing else;
//! * rebuild — what a server does when its checkpoint is gone: `Runner::start` on an empty
//!   checkpoint tree, timed until the projection has applied the last event (decode, fold, body
//!   cache, a checkpoint every `checkpoint_every_events`, as configured by default).
//!
//! Two ratios have targets (issue 9, item 4): the runner's rebuild over the fold of the same log
//! (rebuild rate / fold rate, target ≥ 0.8: what the runner adds to the fold), and the log read
//! over the raw read (target ≥ 0.8: what `EventLog::read` adds to the store). Rebuild rate / raw
//! read rate is printed too, without a target: the fold itself is most of it. Each measure's
//! process CPU time is printed next to its wall time: on a shared 2-core machine the difference
//! is time spent waiting for a core.
//!
//! The last rebuild's runner is stopped (writing its last checkpoint, which then covers the whole
//! log); then [`RESTART_ROUNDS`] times, [`RESTART_NEW_EVENTS`] more events of the same mix are
//! appended while no runner runs, and a runner is started from the checkpoint and timed until it
//! has applied them: the restore (loading every checkpointed entry) and the catch-up are reported
//! apart, next to the full rebuild.
//!
//! The log's timestamps are its own (the append times, so the whole log spans the seconds its
//! appends took), not the generator's: decisions that depend on log time (heartbeat spacing,
//! attention notes) can differ from the generator's fold. The same events are folded either way.
//!
//! One rebuild of a million events takes a minute or more, so this runs outside criterion's
//! sampling and only when a filter names it: `cargo bench -p anima-benches -- rebuild` (both
//! backends), `-- rebuild_embedded`, `-- rebuild_jetstream`; `REBUILD_EVENTS=200000` for a
//! shorter run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anima_engine::checkpoint::{CheckpointDb, CheckpointStore, CHECKPOINT_CACHE_BYTES_DEFAULT};
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{AppendRecord, EventLog};
use anima_engine::replay::{ReplayConfig, Replayer};
use anima_engine::subject::{SubjectPrefix, Subjects};
use anima_engine::testing::NatsServer;
use anima_engine::{Runner, RunnerConfig};
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::surface::SurfaceId;
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;

use crate::measure::{env_count, filter_selects, median, process_cpu_time};
use anima_benches::mix::{generate, MIX_SEED};

/// Events in the log; the environment variable overrides the default.
const REBUILD_EVENTS_ENV: &str = "REBUILD_EVENTS";
const REBUILD_EVENTS_DEFAULT: usize = 1_000_000;
const REBUILD_EVENTS_QUICK: usize = 20_000;
/// Rounds of raw read, log read and rebuild behind the medians (`--test`: one).
const REBUILD_ROUNDS: usize = 3;
/// Restarts from a checkpoint, each after this many new events.
const RESTART_ROUNDS: usize = 3;
const RESTART_NEW_EVENTS: usize = 1_000;
/// Records per `append_batch` while filling the log: ten JetStream ack windows, several embedded
/// group commits.
const APPEND_BATCH_RECORDS: usize = 10_000;
/// Bound on waiting for a runner to catch up: far above any rebuild measured here.
const CATCH_UP_WAIT: Duration = Duration::from_secs(3_600);
/// The embedded log's tree, the key prefix of its record groups and the group value's header
/// (`crates/engine/src/log/embedded.rs`): a version byte, then each record as a u32 BE length and
/// its encoding.
const EMBEDDED_TREE: &str = "log";
const EMBEDDED_PREFIX_GROUP: u8 = b'g';
const EMBEDDED_GROUP_HEADER_BYTES: usize = 1;
const STREAM: &str = "ANIMA";

/// The subjects of the fresh logs benchmarks fill: the default prefix and the newest encoding.
fn subjects() -> Subjects {
    Subjects::newest(SubjectPrefix::default())
}

/// The subject the engine stores an event of the mix on (its handlers in `crates/engine/src/command.rs`).
fn subject_of(envelope: &proto::Envelope) -> String {
    let subjects = subjects();
    let target_subject = |target: &Option<proto::ReplyTarget>| {
        let surface = target.as_ref().and_then(SurfaceId::from_target).expect("the mix's targets are surfaces");
        subjects.surface(&surface)
    };
    match envelope.payload.as_ref().expect("the mix's events have payloads") {
        Payload::SlackMessage(m) => {
            subjects.surface(&SurfaceId::slack_message(&m.team_id, &m.channel_id, &m.ts, &m.thread_ts))
        }
        Payload::Send(request) => target_subject(&request.target),
        Payload::SendConfirmed(confirmation) => target_subject(&confirmation.target),
        Payload::AgentRegistered(registration) => subjects.agent(&registration.agent_id),
        Payload::SubscriptionChange(change) => subjects.agent(&change.agent_id),
        Payload::WakeClaim(request) => subjects.agent(&request.agent_id),
        Payload::WakeStart(request) => subjects.agent(&request.agent_id),
        Payload::WakeFinish(request) => subjects.agent(&request.agent_id),
        Payload::WakeHeartbeat(request) => subjects.agent_heartbeat(&request.agent_id),
        other => panic!("the mix generator made an event this benchmark has no subject for: {other:?}"),
    }
}

/// The generated mix as records to append, in log order.
struct MixRecords {
    records: Vec<AppendRecord>,
    description: String,
}

fn mix_records(total: usize) -> MixRecords {
    let started = Instant::now();
    let mix = generate(MIX_SEED, total);
    let description = format!(
        "mix seed {MIX_SEED:#x}, generated in {:.1?}: {}",
        started.elapsed(),
        mix.counts.describe(mix.events.len())
    );
    let records = mix
        .events
        .into_iter()
        .map(|(_, bytes)| {
            let envelope = proto::Envelope::decode(bytes.as_slice()).expect("the mix decodes");
            AppendRecord { subject: subject_of(&envelope), msg_id: envelope.event_id, payload: Bytes::from(bytes) }
        })
        .collect();
    MixRecords { records, description }
}

/// How the raw baseline reads the store under the log.
enum RawStore {
    Sled(sled::Tree),
    /// Boxed: a context is 200-odd bytes, a tree one pointer.
    JetStream(Box<async_nats::jetstream::Context>),
}

/// One backend's log, its checkpoint database and its raw store.
struct BackendFixture {
    name: &'static str,
    log: Arc<dyn EventLog>,
    checkpoint_db: CheckpointDb,
    raw: RawStore,
    _directory: tempfile::TempDir,
    // Dropped last: stops nats-server.
    _nats: Option<NatsServer>,
}

/// The checkpoint store of the data dir in `directory`.
fn checkpoint_db(directory: &tempfile::TempDir) -> CheckpointDb {
    CheckpointDb::open(&directory.path().join("data"), CHECKPOINT_CACHE_BYTES_DEFAULT)
        .expect("open the checkpoint store")
}

impl BackendFixture {
    /// The embedded log in a sled database and the checkpoints beside it, as an instance's data
    /// dir holds them.
    fn embedded() -> BackendFixture {
        let directory = tempfile::Builder::new().prefix("anima-bench-rebuild-").tempdir().expect("temporary directory");
        let db = sled::Config::new().path(directory.path().join("data")).open().expect("open sled");
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open the embedded log");
        let tree = db.open_tree(EMBEDDED_TREE).expect("the log's tree");
        BackendFixture {
            name: "embedded",
            log: Arc::new(log),
            checkpoint_db: checkpoint_db(&directory),
            raw: RawStore::Sled(tree),
            _directory: directory,
            _nats: None,
        }
    }

    /// A JetStream stream on a nats-server of its own; the checkpoints in a data dir.
    async fn jetstream() -> BackendFixture {
        let nats = NatsServer::start();
        let directory = tempfile::Builder::new().prefix("anima-bench-rebuild-").tempdir().expect("temporary directory");
        let config = JetStreamConfig { url: nats.url(), stream: STREAM.into(), ..JetStreamConfig::default() };
        let log = JetStreamLog::connect(config).await.expect("connect the JetStream log");
        let client = async_nats::connect(nats.url()).await.expect("connect the raw client");
        BackendFixture {
            name: "jetstream",
            log: Arc::new(log),
            checkpoint_db: checkpoint_db(&directory),
            raw: RawStore::JetStream(Box::new(async_nats::jetstream::new(client))),
            _directory: directory,
            _nats: Some(nats),
        }
    }

    async fn append(&self, records: &[AppendRecord]) {
        for batch in records.chunks(APPEND_BATCH_RECORDS) {
            let outcomes = self.log.append_batch(batch.to_vec()).await.expect("append a batch");
            assert!(outcomes.iter().all(|o| !o.is_duplicate()), "every event of the mix has its own id");
        }
    }

    /// Reads every stored record from the store itself; returns (records, bytes). On sled that
    /// is a scan of the group entries and a walk of each group's length frames (the least that
    /// finds every record), counting each record's stored bytes.
    async fn raw_read(&self, last_seq: u64) -> (u64, u64) {
        match &self.raw {
            RawStore::Sled(tree) => {
                let (mut records, mut bytes) = (0u64, 0u64);
                for entry in tree.scan_prefix([EMBEDDED_PREFIX_GROUP]) {
                    let (_, value) = entry.expect("raw sled read");
                    let mut rest = std::hint::black_box(&value[EMBEDDED_GROUP_HEADER_BYTES..]);
                    while let Some((len, tail)) = rest.split_first_chunk::<4>() {
                        let len = u32::from_be_bytes(*len) as usize;
                        records += 1;
                        bytes += std::hint::black_box(&tail[..len]).len() as u64;
                        rest = &tail[len..];
                    }
                }
                (records, bytes)
            }
            RawStore::JetStream(context) => raw_jetstream_read(context, last_seq).await,
        }
    }

    /// `EventLog::read` of the whole log, drained; returns (records, bytes).
    async fn log_read(&self, last_seq: u64) -> (u64, u64) {
        let mut stream = self.log.read(1, last_seq, None).await.expect("log read");
        let (mut records, mut bytes) = (0u64, 0u64);
        while let Some(record) = stream.next().await {
            let record = record.expect("log read");
            records += 1;
            bytes += std::hint::black_box(record.payload).len() as u64;
        }
        (records, bytes)
    }

    /// `Replayer::rebuild` of the newest state; returns the sequence it folded to.
    async fn fold(&self) -> u64 {
        let replayer =
            Replayer::new(self.log.clone(), ReplayConfig { snapshots_kept_max: 0, ..ReplayConfig::default() });
        let rebuilt = replayer.rebuild(None).await.expect("replay rebuild");
        assert!(rebuilt.state.meta.halted.is_none(), "the fold halted: {:?}", rebuilt.state.meta.halted);
        rebuilt.seq
    }

    /// Starts a runner on checkpoint tree `tree` and waits until it has applied `last_seq`.
    /// Returns the running runner, its shutdown token, and the time `Runner::start` took (the
    /// checkpoint's restore) and the whole time.
    async fn start_runner(&self, tree: &str, last_seq: u64) -> (RunningRunner, Duration, Duration) {
        let checkpoints = CheckpointStore::open(&self.checkpoint_db, tree).expect("checkpoint tree");
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let runner = Runner::start(self.log.clone(), checkpoints, RunnerConfig::default(), shutdown.clone())
            .await
            .expect("start the runner");
        let restored = started.elapsed();
        runner.projection.wait_applied(last_seq, CATCH_UP_WAIT).await.expect("the runner caught up");
        let caught_up = started.elapsed();
        {
            let state = runner.projection.state();
            assert!(state.meta.halted.is_none(), "the fold halted: {:?}", state.meta.halted);
            assert_eq!(state.meta.applied_seq, last_seq);
        }
        (RunningRunner { runner, shutdown }, restored, caught_up)
    }
}

struct RunningRunner {
    runner: Runner,
    shutdown: CancellationToken,
}

impl RunningRunner {
    /// Stops it, writing its last checkpoint.
    async fn stop(self) {
        self.shutdown.cancel();
        self.runner.task.await.expect("runner task").expect("runner stopped cleanly");
    }
}

/// A raw async-nats ordered push consumer over the whole stream, until `last_seq`.
async fn raw_jetstream_read(context: &async_nats::jetstream::Context, last_seq: u64) -> (u64, u64) {
    use async_nats::jetstream::consumer::{push, DeliverPolicy};
    let stream = context.get_stream(STREAM).await.expect("the stream");
    let consumer = stream
        .create_consumer(push::OrderedConfig {
            deliver_subject: context.client().new_inbox(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .expect("create a raw consumer");
    let mut messages = consumer.messages().await.expect("raw consumer messages");
    let (mut records, mut bytes) = (0u64, 0u64);
    while let Some(message) = messages.next().await {
        let message = message.expect("raw delivery");
        records += 1;
        bytes += message.message.payload.len() as u64;
        if message.info().expect("delivery info").stream_sequence >= last_seq {
            break;
        }
    }
    (records, bytes)
}

/// What one round measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Measure {
    RawRead,
    LogRead,
    Fold,
    Rebuild,
}

/// Runs the comparison on one backend; returns its summary lines (rebuild, restart).
fn bench_backend(
    runtime: &Runtime,
    fixture: BackendFixture,
    mix: &MixRecords,
    events: usize,
    quick: bool,
) -> [String; 2] {
    let name = fixture.name;
    let (history, new_events) = mix.records.split_at(events);
    let started = Instant::now();
    runtime.block_on(fixture.append(history));
    let appended_in = started.elapsed();
    let last_seq = runtime.block_on(fixture.log.last_seq()).expect("last seq");
    assert_eq!(last_seq, events as u64);
    println!(
        "rebuild_{name}: {events} events appended in {appended_in:.1?} ({:.0} ev/s, batches of {APPEND_BATCH_RECORDS})",
        events as f64 / appended_in.as_secs_f64()
    );

    // Untimed: the first read of a fresh store pays for warming caches the others then share.
    runtime.block_on(fixture.raw_read(last_seq));
    let rounds = if quick { 1 } else { REBUILD_ROUNDS };
    let (mut raw, mut read, mut fold, mut rebuild) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut checkpointed: Option<String> = None;
    for round in 0..rounds {
        let order = if round.is_multiple_of(2) {
            [Measure::RawRead, Measure::LogRead, Measure::Fold, Measure::Rebuild]
        } else {
            [Measure::LogRead, Measure::RawRead, Measure::Rebuild, Measure::Fold]
        };
        for measure in order {
            let cpu_before = process_cpu_time();
            let started = Instant::now();
            let elapsed = match measure {
                Measure::RawRead => {
                    let (records, _) = runtime.block_on(fixture.raw_read(last_seq));
                    let elapsed = started.elapsed();
                    assert_eq!(records, last_seq, "the raw read saw every record");
                    raw.push(elapsed);
                    elapsed
                }
                Measure::LogRead => {
                    let (records, _) = runtime.block_on(fixture.log_read(last_seq));
                    let elapsed = started.elapsed();
                    assert_eq!(records, last_seq, "the log read saw every record");
                    read.push(elapsed);
                    elapsed
                }
                Measure::Fold => {
                    let folded_to = runtime.block_on(fixture.fold());
                    let elapsed = started.elapsed();
                    assert_eq!(folded_to, last_seq);
                    fold.push(elapsed);
                    elapsed
                }
                Measure::Rebuild => {
                    let tree = format!("bench-rebuild-{round}");
                    let (running, _, caught_up) = runtime.block_on(fixture.start_runner(&tree, last_seq));
                    rebuild.push(caught_up);
                    // Untimed: the last checkpoint, and forgetting the previous round's.
                    runtime.block_on(running.stop());
                    if let Some(previous) = checkpointed.replace(tree) {
                        fixture.checkpoint_db.delete(&previous).expect("drop an old checkpoint");
                    }
                    caught_up
                }
            };
            // CPU time up to the end of the untimed part too: a close upper bound.
            let cpu = cpu_before.zip(process_cpu_time()).map(|(before, after)| after.saturating_sub(before));
            let cpu = cpu.map_or_else(String::new, |cpu| format!(" (process CPU {cpu:.2?})"));
            println!("rebuild_{name}: round {round} {measure:?} {elapsed:.2?}{cpu}");
        }
    }
    let rate = |durations: &[Duration]| events as f64 / median(durations).as_secs_f64();
    let (raw_rate, read_rate, fold_rate, rebuild_rate) = (rate(&raw), rate(&read), rate(&fold), rate(&rebuild));
    let raw_name = match &fixture.raw {
        RawStore::Sled(_) => "raw sled scan",
        RawStore::JetStream(_) => "raw async-nats ordered push consumer",
    };
    let rebuild_line = format!(
        "rebuild_{name}: {events} events, rebuild (Runner from an empty checkpoint) {:.1?} = {rebuild_rate:.0} ev/s, \
         fold (Replayer::rebuild) {:.1?} = {fold_rate:.0} ev/s, EventLog::read {:.1?} = {read_rate:.0} ev/s, \
         {raw_name} {:.1?} = {raw_rate:.0} ev/s; ratio rebuild/fold {:.2} (target >= 0.8), \
         log read/raw {:.2} (target >= 0.8), rebuild/raw {:.3}, fold/raw {:.3} (median of {rounds} rounds each)",
        median(&rebuild),
        median(&fold),
        median(&read),
        median(&raw),
        rebuild_rate / fold_rate,
        read_rate / raw_rate,
        rebuild_rate / raw_rate,
        fold_rate / raw_rate,
    );

    // Restarts from the checkpoint the last rebuild left, which covers the whole log.
    let tree = checkpointed.expect("at least one rebuild ran");
    let restart_rounds = if quick { 1 } else { RESTART_ROUNDS };
    let (mut restores, mut restarts) = (Vec::new(), Vec::new());
    let mut last_seq = last_seq;
    for round in 0..restart_rounds {
        let batch = &new_events[round * RESTART_NEW_EVENTS..(round + 1) * RESTART_NEW_EVENTS];
        runtime.block_on(fixture.append(batch));
        let checkpoint_seq = last_seq;
        last_seq += RESTART_NEW_EVENTS as u64;
        let (running, restored, caught_up) = runtime.block_on(fixture.start_runner(&tree, last_seq));
        assert_eq!(running.runner.restored_seq, checkpoint_seq, "the checkpoint covered the log before the new events");
        restores.push(restored);
        restarts.push(caught_up);
        runtime.block_on(running.stop());
        println!("rebuild_{name}: restart {round}: restore {restored:.2?}, caught up {caught_up:.2?}");
    }
    let restart_line = format!(
        "restart_{name}: from a checkpoint of {events}+ events with {RESTART_NEW_EVENTS} new: {:.2?} \
         (restore {:.2?}, catch-up {:.2?}), full rebuild {:.1?}: restart/rebuild {:.3} (median of {restart_rounds})",
        median(&restarts),
        median(&restores),
        median(&restarts).saturating_sub(median(&restores)),
        median(&rebuild),
        median(&restarts).as_secs_f64() / median(&rebuild).as_secs_f64(),
    );
    [rebuild_line, restart_line]
}

/// Runs the backends the filter names; returns their summary lines (none when none is named).
pub fn bench(runtime: &Runtime, quick: bool) -> Vec<String> {
    let embedded = filter_selects("rebuild_embedded");
    let jetstream = filter_selects("rebuild_jetstream");
    if !embedded && !jetstream {
        return Vec::new();
    }
    let events = env_count(REBUILD_EVENTS_ENV, if quick { REBUILD_EVENTS_QUICK } else { REBUILD_EVENTS_DEFAULT });
    assert!(events > 0, "{REBUILD_EVENTS_ENV} must be positive");
    let mix = mix_records(events + RESTART_ROUNDS * RESTART_NEW_EVENTS);
    println!("rebuild: {}", mix.description);
    let mut lines = Vec::new();
    if embedded {
        lines.extend(bench_backend(runtime, BackendFixture::embedded(), &mix, events, quick));
    }
    if jetstream {
        let fixture = runtime.block_on(BackendFixture::jetstream());
        lines.extend(bench_backend(runtime, fixture, &mix, events, quick));
    }
    lines
}
