//! The projection runner: follows the log, applies the pure fold, keeps a bounded cache of row
//! bodies, checkpoints changed state keys to sled, and lets command handlers wait until the fold
//! has applied their request.
//!
//! One runner per engine instance. It owns the only `State`; handlers read it under a short lock
//! and never decide anything themselves.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use anima_projections::changes::StateChanges;
use anima_projections::journal::RowBody;
use anima_projections::proto;
use anima_projections::state::{State, FOLD_VERSION};
use anima_projections::LogPosition;
use futures::{FutureExt, StreamExt};
use prost::Message;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::analytics::MaintainedAnalytics;
use crate::budget::{self, StateShare};
use crate::checkpoint::{CheckpointStore, ColdReads, StoredCold};
use crate::log::{EventLog, LogError, StoredRecord};
use crate::recent_verdicts::{Recent, RecentVerdicts};
use anima_projections::cold::Cold;

/// Tuning of the runner. Every bound has a unit in its name.
#[derive(Clone, Debug)]
pub struct RunnerConfig {
    /// Checkpoint after this many applied events...
    pub checkpoint_every_events: u64,
    /// ...or this long after the previous checkpoint, whichever comes first.
    pub checkpoint_interval: Duration,
    /// Bodies of recent rows kept in memory for rendering; older ones are read from the log.
    pub body_cache_bytes_max: usize,
    /// Events applied under one lock of the state.
    pub apply_batch_events_max: usize,
    /// Memory the fold's state may take, by its own estimate. Beyond it, clean entries of the
    /// cold tables (journal rows, message identities) leave memory once a checkpoint holds them,
    /// and are read back from the checkpoint when a decision needs them. 0: let go of every
    /// clean entry at every chance (tests use it to prove verdicts do not depend on memory).
    pub state_bytes_max: usize,
    /// The whole process's memory budget, bytes: while the process's resident memory is over
    /// nine tenths of it, the state's share is lowered below `state_bytes_max` (to a quarter of
    /// it at least; see [`crate::budget`]). 0: the state is held to `state_bytes_max` alone.
    pub process_bytes_max: usize,
    /// After this long without a new event, once its checkpoints have landed, the runner has
    /// the checkpoint store write its memtable out and start a new journal
    /// ([`CheckpointStore::write_out_memtable`]), as a stop does: a crash in a quiet spell then
    /// leaves a short journal for the next start to read, not the tens of MiB a busy spell
    /// wrote. Once per quiet spell, and only for a journal of 8 MiB or more.
    pub idle_write_out_after: Duration,
}

/// A quiet spell long enough to take for one: no new event for 30 s. The write-out may pad the
/// journal with up to 56 MiB that nobody waits for, so it is kept for real lulls (a night, the
/// end of a catch-up), not the gaps of steady traffic.
pub const IDLE_WRITE_OUT_AFTER_DEFAULT: Duration = Duration::from_secs(30);

impl Default for RunnerConfig {
    fn default() -> Self {
        RunnerConfig {
            checkpoint_every_events: 2_000,
            checkpoint_interval: Duration::from_secs(5),
            body_cache_bytes_max: 64 * 1024 * 1024,
            apply_batch_events_max: 256,
            state_bytes_max: 576 * 1024 * 1024,
            process_bytes_max: 0,
            idle_write_out_after: IDLE_WRITE_OUT_AFTER_DEFAULT,
        }
    }
}

/// Bodies of recent journal rows by log sequence, bounded in bytes; the oldest go first.
#[derive(Default)]
pub struct BodyCache {
    bodies: BTreeMap<u64, Arc<RowBody>>,
    bytes: usize,
    bytes_max: usize,
}

impl BodyCache {
    fn insert(&mut self, seq: u64, body: RowBody) {
        self.bytes += body.size_bytes();
        self.bodies.insert(seq, Arc::new(body));
        while self.bytes > self.bytes_max {
            let Some((_, old)) = self.bodies.pop_first() else { break };
            self.bytes -= old.size_bytes();
        }
    }

    pub fn get(&self, seq: u64) -> Option<Arc<RowBody>> {
        self.bodies.get(&seq).cloned()
    }
}

/// The state shared by the runner and the command handlers.
pub struct Projection {
    state: Mutex<State>,
    /// Analytics counters, updated with the fold (locked after `state` when both are held).
    analytics: Mutex<MaintainedAnalytics>,
    bodies: Mutex<BodyCache>,
    /// The newest log sequence the runner has handed to the fold.
    applied: watch::Sender<u64>,
    /// Why the runner stopped, once it has: nobody waits for a fold that will not move again.
    stopped: watch::Sender<Option<Arc<str>>>,
    log: Arc<dyn EventLog>,
    /// The state's own estimate of the memory it takes, bytes, as of the runner's last look (at
    /// start and after each landed checkpoint), and the budget it is held to now (its share of
    /// the memory budget, which the process's resident memory moves): for metrics, read without
    /// the state lock.
    state_estimate_bytes: AtomicU64,
    state_budget_bytes: AtomicU64,
    /// The fold's reads of state it had let go of, back from the checkpoint store.
    cold_reads: Arc<ColdReads>,
    /// How long the start's restore from the checkpoint took (the state and the analytics).
    restore_took: Duration,
    /// The agents the fold has registered (it never removes one), kept beside the state so that
    /// the check every ingest and command makes before it appends ([`Projection::is_registered`])
    /// does not wait for the state lock: the fold holds that lock while it reads state back from
    /// the checkpoint store, 20–41 ms about every 7.5 s under `anima-load` (README, stop 58).
    registered: RwLock<HashSet<String>>,
    /// The verdicts of the newest applied events, so that a request whose event is applied
    /// reads its verdict without waiting for the state lock ([`Projection::recent_verdict`]).
    recent: Mutex<RecentVerdicts>,
}

/// A hold of the state lock this long or longer is logged (debug), with where it was taken: the
/// slowest Send the load targets allow is 25 ms, and a hold of this length is most of it.
pub const STATE_LOCK_HELD_LOGGED: Duration = Duration::from_millis(20);

/// The state, locked ([`Projection::state`]); logs its own hold when it was long.
pub struct StateGuard<'a> {
    guard: MutexGuard<'a, State>,
    since: Instant,
    taken_at: &'static std::panic::Location<'static>,
}

impl StateGuard<'_> {
    /// How long the lock has been held so far.
    pub fn held(&self) -> Duration {
        self.since.elapsed()
    }
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let held = self.held();
        if held >= STATE_LOCK_HELD_LOGGED {
            tracing::debug!(held_ms = held.as_secs_f64() * 1e3, taken_at = %self.taken_at, "state lock held long");
        }
    }
}

/// Errors of waiting for the fold.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The fold did not reach the sequence in time (log slow or runner stopped). Retry later
    /// with the same request id.
    #[error("the fold did not reach seq {seq} within {waited:?}")]
    Timeout { seq: u64, waited: Duration },
    /// The runner stopped (shut down, or failed with `cause`): this instance will not decide
    /// again. Retry against another instance, or after the restart.
    #[error("the projection runner stopped: {cause}")]
    Stopped { cause: Arc<str> },
}

impl Projection {
    /// Locks the state for reading (or for the runner, applying). Keep the guard short and never
    /// across an await: every request waiting for its verdict waits for it. A guard held
    /// [`STATE_LOCK_HELD_LOGGED`] or longer is logged (debug) with the place that took it.
    #[track_caller]
    pub fn state(&self) -> StateGuard<'_> {
        let guard = self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        StateGuard { guard, since: Instant::now(), taken_at: std::panic::Location::caller() }
    }

    /// Whether the fold has registered `agent` (as of the last batch it applied).
    pub fn is_registered(&self, agent: &str) -> bool {
        self.registered.read().unwrap_or_else(|poisoned| poisoned.into_inner()).contains(agent)
    }

    /// What the newest applied batches decided about `seq`, which the fold has applied, without
    /// the state lock: the fold holds that lock through a whole batch, tens of milliseconds
    /// when the batch reads state back while the checkpoint store installs a new version.
    /// [`Recent::NotKept`] sends the caller to the state.
    pub fn recent_verdict(&self, seq: u64) -> Recent {
        self.recent.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(seq)
    }

    /// The state's memory by its own estimate (bytes, as of the runner's last look: at start and
    /// after each landed checkpoint) and the budget it is held to now (`state_bytes_max`, or
    /// less while the process is over nine tenths of `process_bytes_max`).
    pub fn state_memory_bytes(&self) -> (u64, u64) {
        (self.state_estimate_bytes.load(Ordering::Relaxed), self.state_budget_bytes.load(Ordering::Relaxed))
    }

    /// How long the start's restore from the checkpoint took, for the `anima_restore_seconds`
    /// gauge.
    pub fn restore_took(&self) -> Duration {
        self.restore_took
    }

    /// The fold's reads back from the checkpoint store so far: (reads, entries, seconds).
    pub fn cold_reads(&self) -> (u64, u64, f64) {
        self.cold_reads.totals()
    }

    /// The maintained analytics counters. Keep the guard short.
    pub fn analytics(&self) -> MutexGuard<'_, MaintainedAnalytics> {
        self.analytics.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn applied_seq(&self) -> u64 {
        *self.applied.borrow()
    }

    /// A receiver that changes whenever the fold applied more events (for live streams).
    pub fn subscribe_applied(&self) -> watch::Receiver<u64> {
        self.applied.subscribe()
    }

    /// Waits until the fold has applied `seq`. Answers at once, with the cause, when the runner
    /// has stopped and `seq` is beyond what it applied.
    pub async fn wait_applied(&self, seq: u64, timeout: Duration) -> Result<(), WaitError> {
        let mut applied = self.applied.subscribe();
        let mut stopped = self.stopped.subscribe();
        let reached = async {
            tokio::select! {
                biased;
                result = applied.wait_for(|applied| *applied >= seq) => result.is_ok(),
                _ = stopped.wait_for(Option::is_some) => false,
            }
        };
        match tokio::time::timeout(timeout, reached).await {
            Ok(true) => Ok(()),
            Ok(false) if self.applied_seq() >= seq => Ok(()),
            Ok(false) => Err(self
                .stop_cause()
                .map_or(WaitError::Timeout { seq, waited: timeout }, |cause| WaitError::Stopped { cause })),
            Err(_) => Err(WaitError::Timeout { seq, waited: timeout }),
        }
    }

    /// Why the runner stopped, once it has (`None` while it runs).
    pub fn stop_cause(&self) -> Option<Arc<str>> {
        self.stopped.borrow().clone()
    }

    /// A receiver that changes once, when the runner stops (its value is the cause).
    pub fn subscribe_stopped(&self) -> watch::Receiver<Option<Arc<str>>> {
        self.stopped.subscribe()
    }

    /// The bodies of rows at `seqs`: from the cache, else read from the log concurrently.
    pub async fn bodies(&self, seqs: &[u64]) -> Result<BTreeMap<u64, Arc<RowBody>>, LogError> {
        let mut found = BTreeMap::new();
        let mut missing = Vec::new();
        {
            let cache = self.bodies.lock().unwrap_or_else(|p| p.into_inner());
            for &seq in seqs {
                match cache.get(seq) {
                    Some(body) => {
                        found.insert(seq, body);
                    }
                    None => missing.push(seq),
                }
            }
        }
        let fetched = futures::future::join_all(missing.iter().map(|&seq| self.log.get(seq))).await;
        for (seq, record) in missing.into_iter().zip(fetched) {
            let record =
                record?.ok_or_else(|| LogError::Store(format!("row body at seq {seq} is missing from the log")))?;
            let envelope = proto::Envelope::decode(record.payload.as_ref())
                .map_err(|e| LogError::Store(format!("event at seq {seq} does not decode: {e}")))?;
            let body = RowBody::from_envelope(&envelope)
                .ok_or_else(|| LogError::Store(format!("event at seq {seq} is not a journal row")))?;
            found.insert(seq, Arc::new(body));
        }
        Ok(found)
    }
}

/// A running projection runner: its shared projection and the task that owns the fold.
pub struct Runner {
    pub projection: Arc<Projection>,
    /// The applied seq the checkpoint restored (0: started empty).
    pub restored_seq: u64,
    pub task: tokio::task::JoinHandle<Result<(), RunnerError>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("checkpoint store: {0}")]
    Checkpoint(String),
}

impl Runner {
    /// Restores state from a valid checkpoint (same fold version and stream) or starts empty,
    /// then follows the log until `shutdown` is cancelled, checkpointing as configured. On
    /// shutdown it writes a last checkpoint.
    pub async fn start(
        log: Arc<dyn EventLog>,
        checkpoints: CheckpointStore,
        config: RunnerConfig,
        shutdown: CancellationToken,
    ) -> Result<Runner, RunnerError> {
        let stream_identity = log.identity();
        let restoring = Instant::now();
        let mut state =
            checkpoints.restore(&stream_identity).await.map_err(|e| RunnerError::Checkpoint(e.to_string()))?;
        // A checkpoint at seq 0 folded nothing, so it left nothing cold in the store either.
        let restored = state.meta.applied_seq > 0;
        let cold_reads = Arc::new(ColdReads::default());
        state.attach_cold(Cold::new(Arc::new(StoredCold::new(&checkpoints, cold_reads.clone()))), restored);
        let analytics = checkpoints.restore_analytics().await.map_err(|e| RunnerError::Checkpoint(e.to_string()))?;
        let start_seq = state.meta.applied_seq;
        let restore_took = restoring.elapsed();
        tracing::info!(
            seq = start_seq,
            fold_version = FOLD_VERSION,
            restore_ms = restore_took.as_secs_f64() * 1e3,
            "projection restored"
        );
        let (applied, _) = watch::channel(start_seq);
        let state_estimate_bytes = AtomicU64::new(state.memory_estimate_bytes() as u64);
        let registered = RwLock::new(state.agents.iter().map(|(agent, _)| agent.clone()).collect());
        let projection = Arc::new(Projection {
            state: Mutex::new(state),
            analytics: Mutex::new(analytics),
            bodies: Mutex::new(BodyCache { bytes_max: config.body_cache_bytes_max, ..BodyCache::default() }),
            applied,
            stopped: watch::channel(None).0,
            log: log.clone(),
            state_estimate_bytes,
            state_budget_bytes: AtomicU64::new(config.state_bytes_max as u64),
            cold_reads,
            restore_took,
            registered,
            recent: Mutex::new(RecentVerdicts::default()),
        });
        let supervised = projection.clone();
        let task = tokio::spawn(async move {
            let result = run(log, supervised.clone(), checkpoints, config, shutdown, stream_identity).await;
            let cause: Arc<str> = match &result {
                Ok(()) => "the instance is shutting down".into(),
                Err(e) => {
                    tracing::error!(error = %e, "projection runner failed; this instance stops deciding");
                    e.to_string().into()
                }
            };
            supervised.stopped.send_replace(Some(cause));
            result
        });
        Ok(Runner { projection, restored_seq: start_seq, task })
    }
}

/// A checkpoint write running beside the fold.
type CheckpointWrite = tokio::task::JoinHandle<Result<(), RunnerError>>;

async fn run(
    log: Arc<dyn EventLog>,
    projection: Arc<Projection>,
    checkpoints: CheckpointStore,
    config: RunnerConfig,
    shutdown: CancellationToken,
    stream_identity: String,
) -> Result<(), RunnerError> {
    // At most one checkpoint write in flight, beside the fold: a sled flush never holds up the
    // requests waiting for their verdicts. Writes stay in order because the next one starts only
    // after the previous one finished.
    let mut writing: Option<CheckpointWrite> = None;
    if checkpoints.take_long_journal_read_at_open() {
        // Before the first checkpoint, which waits for it like for any write in flight.
        writing = Some(write_out_in_flight(&checkpoints, "start"));
    }
    let result =
        follow_and_apply(&log, &projection, &checkpoints, &config, &shutdown, &stream_identity, &mut writing).await;
    // Whatever ended the loop, the write in flight finishes before the runner does, so no write
    // of this runner can land after a successor's.
    let stopping = Instant::now();
    if let Some(writing) = writing {
        let written = writing.await.map_err(|e| RunnerError::Checkpoint(format!("checkpoint task: {e}")));
        written??;
    }
    result?;
    let in_flight_ms = stopping.elapsed().as_secs_f64() * 1e3;
    let changes = take_changes(&projection);
    let entries = changes.0.len();
    write_checkpoint(&checkpoints, &stream_identity, changes, true).await?;
    let last_ms = stopping.elapsed().as_secs_f64() * 1e3 - in_flight_ms;
    // Only for the next start's speed (see there): a failure here loses nothing.
    if let Err(e) = checkpoints.write_out_memtable("stop").await {
        tracing::warn!(error = %e, "the checkpoint store's memtable was not written out at the stop");
    }
    let write_out_ms = stopping.elapsed().as_secs_f64() * 1e3 - in_flight_ms - last_ms;
    tracing::info!(
        seq = projection.applied_seq(),
        in_flight_ms = %format_args!("{in_flight_ms:.0}"),
        last_entries = entries,
        last_ms = %format_args!("{last_ms:.0}"),
        write_out_ms = %format_args!("{write_out_ms:.0}"),
        "projection runner stopped (the checkpoint write in flight, the last checkpoint, the store's write-out)"
    );
    Ok(())
}

/// The checkpoint store's write-out ([`CheckpointStore::write_out_memtable`]) as the runner's
/// write in flight, so the next checkpoint waits for it; `at` names the moment (`start`,
/// `idle`). Only for the next start's speed: a failure is logged and loses nothing.
fn write_out_in_flight(checkpoints: &CheckpointStore, at: &'static str) -> CheckpointWrite {
    let checkpoints = checkpoints.clone();
    tokio::spawn(async move {
        if let Err(e) = checkpoints.write_out_memtable(at).await {
            tracing::warn!(error = %e, at, "the checkpoint store's journal was not replaced");
        }
        Ok(())
    })
}

/// Follows the log and applies it until `shutdown`, starting checkpoint writes as they fall due.
async fn follow_and_apply(
    log: &Arc<dyn EventLog>,
    projection: &Arc<Projection>,
    checkpoints: &CheckpointStore,
    config: &RunnerConfig,
    shutdown: &CancellationToken,
    stream_identity: &str,
    writing: &mut Option<CheckpointWrite>,
) -> Result<(), RunnerError> {
    let mut stream = log.follow(projection.applied_seq() + 1, None).await?;
    let mut since_checkpoint = 0u64;
    let mut last_checkpoint = Instant::now();
    let mut eviction = Eviction::default();
    let mut share = StateShare::new(config.state_bytes_max, config.process_bytes_max);
    let mut tick = tokio::time::interval(config.checkpoint_interval);
    let mut last_event = Instant::now();
    // Whether this quiet spell's write-out is done (or there was nothing to write out): set
    // until the first event, since the start already replaced a long journal it read.
    let mut quiet_written_out = true;
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => None,
            next = stream.next() => match next {
                Some(record) => Some(record?),
                None => return Err(RunnerError::Log(LogError::Unavailable("the log's follow stream ended".into()))),
            },
        };
        if let Some(first) = first {
            let mut batch = vec![first];
            while batch.len() < config.apply_batch_events_max {
                match stream.next().now_or_never() {
                    Some(Some(record)) => batch.push(record?),
                    Some(None) => break,
                    None => break,
                }
            }
            since_checkpoint += batch.len() as u64;
            apply_batch(projection, &batch);
            last_event = Instant::now();
            quiet_written_out = false;
        }
        let due = since_checkpoint >= config.checkpoint_every_events
            || (since_checkpoint > 0 && last_checkpoint.elapsed() >= config.checkpoint_interval);
        if let Some(done) = writing.as_mut().and_then(|w| w.now_or_never()) {
            *writing = None;
            done.map_err(|e| RunnerError::Checkpoint(format!("checkpoint task: {e}")))??;
            // Once per landed checkpoint: the estimate walks the queues, which is not work for
            // every batch.
            let state_bytes_max = share.adjust(Instant::now(), budget::process_resident_bytes);
            projection.state_budget_bytes.store(state_bytes_max as u64, Ordering::Relaxed);
            eviction.measure(projection, state_bytes_max);
        }
        if writing.is_none() {
            // No write in flight: the checkpoint holds every clean entry's latest value, so
            // those may leave memory now (and only now), a slice per batch.
            eviction.slice(projection);
        }
        if due && writing.is_none() {
            let changes = take_changes(projection);
            let (checkpoints, stream_identity) = (checkpoints.clone(), stream_identity.to_owned());
            *writing =
                Some(tokio::spawn(
                    async move { write_checkpoint(&checkpoints, &stream_identity, changes, false).await },
                ));
            since_checkpoint = 0;
            last_checkpoint = Instant::now();
        } else if writing.is_none()
            && since_checkpoint == 0
            && !quiet_written_out
            && last_event.elapsed() >= config.idle_write_out_after
        {
            // Every checkpoint of the busy spell has landed.
            quiet_written_out = true;
            *writing = Some(write_out_in_flight(checkpoints, "idle"));
        }
    }
    Ok(())
}

/// Cold entries let go of under one hold of the state lock at most: every request waiting for
/// its verdict waits for the slice in progress. Under `anima-load` (JetStream, 180 s), rounds of
/// up to 16,384 entries per cold table, one per landed checkpoint, held the lock 5 ms at the
/// median and 15.7 ms at p99 (36 ms at most), two or three times a second, with the Send p99 at
/// 9.7 ms. A slice of 2,048 is about a millisecond; the fold applies a batch between two slices
/// and, while no checkpoint write is in flight, evicts a slice after each batch.
const EVICTED_PER_SLICE_MAX: usize = 2_048;

/// Letting cold entries go while the fold's state is over its budget, a slice at a time.
#[derive(Default)]
struct Eviction {
    /// Entries still to let go of, from the last estimate.
    owed: usize,
    /// What one entry let go of frees, by the last estimate (the cold entries' mean).
    entry_bytes: usize,
    /// Keys the hands looked at, at most, since a slice last let an entry go.
    looked_in_vain: usize,
    /// Since the last estimate: entries let go of, slices, and the longest hold of the lock.
    let_go: usize,
    slices: usize,
    longest: Duration,
}

impl Eviction {
    /// Estimates the state's memory (the gauge shows it) and how many cold entries must leave
    /// memory to bring it under `state_bytes_max`.
    fn measure(&mut self, projection: &Projection, state_bytes_max: usize) {
        let (estimate, resident, keys, entry_bytes) = {
            let state = projection.state();
            (
                state.memory_estimate_bytes(),
                state.cold_resident_len(),
                state.cold_keys_len(),
                state.cold_entry_bytes_mean(),
            )
        };
        if self.slices > 0 {
            tracing::debug!(
                let_go = self.let_go,
                slices = self.slices,
                longest_ms = self.longest.as_secs_f64() * 1e3,
                resident,
                known_absent = keys - resident,
                "cold state entries left memory"
            );
        }
        projection.state_estimate_bytes.store(estimate as u64, Ordering::Relaxed);
        let over = estimate > state_bytes_max || state_bytes_max == 0;
        let over_entries = (estimate - state_bytes_max.min(estimate)) / entry_bytes + 1;
        *self = Eviction { owed: if over { over_entries } else { 0 }, entry_bytes, ..Eviction::default() };
    }

    /// Lets one slice of the entries owed leave memory. A slice may let nothing go (the entries
    /// its hands looked at all changed since the checkpoint or used since they last passed, as
    /// every entry is when the state first reaches its budget); the round goes on until the
    /// hands have looked at twice the keys in memory without letting one go, and then waits for
    /// the next estimate, at the next landed checkpoint.
    fn slice(&mut self, projection: &Projection) {
        if self.owed == 0 {
            return;
        }
        let asked = self.owed.min(EVICTED_PER_SLICE_MAX);
        let started = Instant::now();
        let (let_go, keys) = {
            let mut state = projection.state();
            let let_go = state.evict_cold(asked);
            (let_go, state.cold_keys_len())
        };
        self.longest = self.longest.max(started.elapsed());
        self.slices += 1;
        self.let_go += let_go;
        if let_go == 0 {
            self.looked_in_vain += asked * anima_projections::cold::EVICTION_STEPS_PER_ENTRY;
            if self.looked_in_vain >= 2 * keys {
                self.owed = 0;
            }
        } else {
            self.looked_in_vain = 0;
            self.owed = self.owed.saturating_sub(let_go);
        }
        let left =
            projection.state_estimate_bytes.load(Ordering::Relaxed).saturating_sub((let_go * self.entry_bytes) as u64);
        projection.state_estimate_bytes.store(left, Ordering::Relaxed);
    }
}

fn apply_batch(projection: &Projection, batch: &[StoredRecord]) {
    let mut bodies = Vec::new();
    // Decoding and redacting need no state: done before the lock, so requests reading state
    // never wait on them. An event the fold decodes is redacted from that decode as far as the
    // maintained counters read it (no second, dynamic decode).
    let redactor = anima_projections::redact::Redactor::schema();
    let decoded: Vec<_> = batch
        .iter()
        .map(|r| {
            let envelope = proto::Envelope::decode(r.payload.as_ref());
            let event = match &envelope {
                Ok(envelope) => redactor.redact_counted(r.seq, r.timestamp_ns, &r.subject, &r.payload, envelope),
                Err(_) => redactor.redact(r.seq, r.timestamp_ns, &r.subject, &r.payload),
            };
            (envelope, event)
        })
        .collect();
    let registering: Vec<String> = decoded
        .iter()
        .filter_map(|(envelope, _)| match envelope.as_ref().ok()?.payload.as_ref()? {
            proto::envelope::Payload::AgentRegistered(registration) => Some(registration.agent_id.clone()),
            _ => None,
        })
        .collect();
    let cold_before = projection.cold_reads();
    let applied_before = projection.applied_seq();
    let mut verdicts = Vec::with_capacity(batch.len());
    let (last, halted) = {
        let mut state = projection.state();
        let mut analytics = projection.analytics();
        for (record, (envelope, event)) in batch.iter().zip(decoded) {
            let at = LogPosition { seq: record.seq, at_ns: record.timestamp_ns };
            match envelope {
                Ok(envelope) => {
                    state.apply(at, &envelope);
                    if let Some(body) = RowBody::from_envelope(&envelope) {
                        bodies.push((record.seq, body));
                    }
                }
                Err(_) => state.apply_bytes(at, record.payload.as_ref()),
            }
            let kept = state.verdicts.get(record.seq);
            analytics.observe_redacted(event, kept.and_then(|kept| kept.get()));
            if let Some(kept) = kept {
                verdicts.push((record.seq, kept.clone()));
            }
        }
        if !registering.is_empty() {
            let mut registered = projection.registered.write().unwrap_or_else(|poisoned| poisoned.into_inner());
            registered.extend(registering.into_iter().filter(|agent| state.agents.contains_key(agent.as_str())));
        }
        if state.held() >= STATE_LOCK_HELD_LOGGED {
            // The guard logs the hold itself; this says how many events it was, and how much of
            // it the fold spent reading state back from the checkpoint store (the count starts
            // before the lock is taken, so a request that held it just before adds its reads).
            let cold_after = projection.cold_reads();
            tracing::debug!(
                events = batch.len(),
                cold_reads = cold_after.0.saturating_sub(cold_before.0),
                cold_entries = cold_after.1.saturating_sub(cold_before.1),
                cold_ms = %format_args!("{:.1}", (cold_after.2 - cold_before.2) * 1e3),
                "slow fold batch"
            );
        }
        (batch.last().map(|r| r.seq), state.meta.halted.clone())
    };
    if !bodies.is_empty() {
        let mut cache = projection.bodies.lock().unwrap_or_else(|p| p.into_inner());
        for (seq, body) in bodies {
            cache.insert(seq, body);
        }
    }
    if let (Some(first), Some(last)) = (batch.first(), last) {
        // Before the applied seq moves: a request that sees its seq applied finds its verdict.
        projection.recent.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).publish(
            first.seq.max(applied_before + 1),
            last,
            verdicts,
            halted.as_ref(),
        );
        projection.applied.send_replace(last);
    }
}

/// Changed checkpoint entries: the state's, taken and not yet encoded, and the analytics
/// counters'.
type Changes = (StateChanges, Vec<(Vec<u8>, Option<Vec<u8>>)>);

/// Takes both change sets at one point of the fold (only the runner applies, and it is here),
/// so the checkpoint's counters cover exactly the events its state has applied. The fold waits
/// while this runs, so the state's changes are only copied out here; they are encoded by the
/// checkpoint write, beside the fold.
fn take_changes(projection: &Projection) -> Changes {
    let started = Instant::now();
    let state = projection.state().take_changes();
    let analytics = projection.analytics().drain_changes();
    tracing::debug!(entries = state.len(), take_ms = started.elapsed().as_secs_f64() * 1e3, "checkpoint taken");
    (state, analytics)
}

async fn write_checkpoint(
    checkpoints: &CheckpointStore,
    stream_identity: &str,
    (changes, analytics): Changes,
    durable: bool,
) -> Result<(), RunnerError> {
    let started = Instant::now();
    let changes = checkpoints
        .background(move || changes.encode())
        .await
        .map_err(|e| RunnerError::Checkpoint(format!("checkpoint encoding task: {e}")))?;
    let encode_ms = started.elapsed().as_secs_f64() * 1e3;
    if tracing::enabled!(tracing::Level::TRACE) {
        let mut by_tag = std::collections::BTreeMap::<u8, (usize, usize)>::new();
        for (key, value) in &changes {
            let entry = by_tag.entry(key[0]).or_default();
            entry.0 += 1;
            entry.1 += usize::from(value.is_none());
        }
        tracing::trace!(?by_tag, "checkpoint entries by table tag (entries, removals)");
    }
    let entries = changes.len();
    let bytes: usize = changes.iter().map(|(k, v)| k.len() + v.as_ref().map_or(0, Vec::len)).sum();
    let written = checkpoints.write(stream_identity, changes, analytics, durable).await;
    tracing::debug!(entries, bytes, encode_ms, write_ms = started.elapsed().as_secs_f64() * 1e3, "checkpoint written");
    written.map_err(|e| RunnerError::Checkpoint(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Short messages are mostly fixed overhead: a cache bounded by bytes keeps no more of them
    /// than their real size allows (it once counted text bytes only and held several times its
    /// bound in memory).
    #[test]
    fn the_body_cache_counts_what_short_messages_really_take() {
        let bytes_max = 1024 * 1024;
        let mut cache = BodyCache { bytes_max, ..BodyCache::default() };
        for seq in 0..100_000u64 {
            let body = RowBody { text: "ok".into(), user_name: "U1".into(), files: vec![], previews: vec![] };
            cache.insert(seq, body);
        }
        let real_floor = std::mem::size_of::<RowBody>() + 4;
        assert!(cache.bytes <= bytes_max);
        assert!(cache.bodies.len() * real_floor <= bytes_max, "{} bodies kept", cache.bodies.len());
        assert!(cache.get(99_999).is_some() && cache.get(0).is_none(), "the newest stay, the oldest go");
    }
}
