//! Replay for incident debugging and the fold-backed analytics views.
//!
//! Everything here is rebuilt from the log: a [`Replayer`] reads stored events and folds them
//! into its own [`State`], never touching a live projection. It answers
//! * [`Replayer::read`]: stored events of a range (sequence or log time), filtered by agent,
//!   surface or event type, optionally with the verdict the fold recorded for each;
//! * [`Replayer::rebuild`]: the state as of a sequence or a log time, folded from the start or
//!   from a snapshot kept from an earlier rebuild at or before that point;
//! * [`Replayer::explain`]: the verdict the fold records when it applies `seq` to the state at
//!   `seq − 1`, and the facts that verdict carries, rendered (never decided a second time);
//! * [`Replayer::counts`]: content-free counts and derived figures of a range, from redacted
//!   events and their verdicts;
//! * [`tap`]: redacted events from a sequence, then live.
//!
//! [`DirectSource`] opens a log without a server: an embedded data dir (sled locks it, so only
//! when no server holds it) or a JetStream stream; it also verifies a checkpoint against a
//! rebuild ([`DirectSource::verify`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anima_projections::do_not_contact::NotContactedReason;
use anima_projections::journal::RowMeta;
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::redact::refusal_name;
use anima_projections::redact::{AnalyticsCounts, RedactedEvent, RedactedOutcome, Redactor, TimeBucket};
use anima_projections::state::{Halt, FOLD_VERSION};
use anima_projections::subscription::Route;
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::{ClaimVerdict, SendVerdict, Verdict};
use anima_projections::wake::NotQueued;
use anima_projections::{LogPosition, State};
use futures::stream::{self, BoxStream, StreamExt};
use prost::Message;
use sha2::{Digest, Sha256};

use crate::checkpoint::{FOLD_VERSION_KEY, STREAM_KEY};
use crate::log::embedded::{EmbeddedConfig, EmbeddedLog};
use crate::log::jetstream::{JetStreamConfig, JetStreamLog};
use crate::log::{EventLog, LogError, StoredRecord, SubjectFilter};
use crate::projection::Projection;
use crate::subject::Subjects;

/// Errors of replay operations, each saying what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// Fix the named field. Maps to `INVALID_ARGUMENT`.
    #[error("{field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
    /// Nothing is stored there. Maps to `NOT_FOUND`.
    #[error("{0}")]
    NotFound(String),
    /// The log failed: `Unavailable` may be retried, `Store` is an inconsistent store.
    #[error(transparent)]
    Log(#[from] LogError),
    /// A running server holds the data dir (sled allows one process). Go through its API, or
    /// stop it.
    #[error(
        "data dir {path} is locked by a running anima-wake (sled allows one process at a time); \
         go through its API (--api http://127.0.0.1:50051) or stop it"
    )]
    Locked { path: String },
    /// The source cannot be opened as asked (no log there, no checkpoint). Fix the invocation.
    #[error("{0}")]
    Source(String),
}

fn invalid(field: &'static str, reason: impl Into<String>) -> ReplayError {
    ReplayError::InvalidArgument { field, reason: reason.into() }
}

/// Runs `work` on tokio's blocking threads. A copy, a walk or a hash of a whole state takes up
/// to seconds at a fleet's history; on an async worker it would hold every request queued behind
/// that worker meanwhile (`anima-load` with `Replay.StateAt` every 5 s saw a Send wait 4.2 s; see
/// README, "Load it"). A panic in `work` goes on as a panic of the caller.
pub async fn off_the_workers<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> Result<T, ReplayError> {
    tokio::task::spawn_blocking(work).await.map_err(|e| match e.try_into_panic() {
        Ok(panic) => std::panic::resume_unwind(panic),
        Err(_) => ReplayError::Log(LogError::Unavailable("the server is stopping".to_owned())),
    })
}

/// Drops `value` on tokio's blocking threads when in a runtime (inline otherwise): freeing a
/// whole state takes about as long as a walk of it.
fn free_off_the_workers<T: Send + 'static>(value: T) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn_blocking(move || drop(value))),
        Err(_) => drop(value),
    }
}

/// `rebuilt` owned: taken when nobody else holds it, else copied off the async workers.
async fn owned(rebuilt: Arc<Rebuilt>) -> Result<Rebuilt, ReplayError> {
    match Arc::try_unwrap(rebuilt) {
        Ok(owned) => Ok(owned),
        Err(shared) => off_the_workers(move || Rebuilt::clone(&shared)).await,
    }
}

/// A point in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogPoint {
    Seq(u64),
    /// Unix ns: as a start, the first event at or after it; as an end, the newest at or before.
    TimeNs(i64),
}

/// An inclusive range of the log; `None` ends are the first and the newest event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogRange {
    pub from: Option<LogPoint>,
    pub to: Option<LogPoint>,
}

/// Which events. Empty fields do not filter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventFilter {
    /// Events whose payload names the agent (any `*agent_id` field).
    pub agent: Option<String>,
    /// Events stored on the surface's subject (built with the log's own prefix and encoding, so
    /// clients name surfaces, never subjects).
    pub surface: Option<SurfaceId>,
    /// Payload names as in `Envelope`.
    pub event_types: BTreeSet<String>,
}

impl EventFilter {
    /// The subject of the surface asked for, in `subjects` (the log's).
    fn surface_subject(&self, subjects: &Subjects) -> Option<String> {
        self.surface.as_ref().map(|surface| subjects.surface(surface))
    }

    pub fn is_empty(&self) -> bool {
        self.agent.is_none() && self.surface.is_none() && self.event_types.is_empty()
    }

    /// Whether a record passes; its event type when it does. `surface_subject` is
    /// [`EventFilter::surface_subject`] in the log's subjects.
    fn matches(&self, record: &StoredRecord, surface_subject: Option<&str>) -> Option<String> {
        let redactor = Redactor::schema();
        if let Some(surface_subject) = surface_subject {
            if record.subject.as_str() != surface_subject {
                return None;
            }
        }
        if let Some(agent) = &self.agent {
            let redacted = redactor.redact(record.seq, record.timestamp_ns, &record.subject, &record.payload);
            let passes = redacted.names_agent(agent)
                && (self.event_types.is_empty() || self.event_types.contains(&redacted.event_type));
            return passes.then_some(redacted.event_type);
        }
        let event_type = redactor.event_type(&record.payload);
        (self.event_types.is_empty() || self.event_types.contains(&event_type)).then_some(event_type)
    }
}

/// What to read.
#[derive(Clone, Debug, Default)]
pub struct ReadQuery {
    pub range: LogRange,
    pub filter: EventFilter,
    /// Fold from the first event and attach each event's recorded verdict.
    pub with_verdicts: bool,
    /// At most this many events.
    pub limit: Option<u64>,
}

/// One stored event as replay returns it.
#[derive(Clone, Debug)]
pub struct ReplayedEvent {
    pub record: StoredRecord,
    pub event_type: String,
    /// With [`ReadQuery::with_verdicts`]: the verdict the fold recorded (`None`: the event
    /// records none, e.g. a payload this fold skips, or the fold had stopped).
    pub verdict: Option<Verdict>,
}

/// State folded up to a point of the log.
#[derive(Clone, Debug)]
pub struct Rebuilt {
    pub state: State,
    /// The last sequence folded (0: nothing).
    pub seq: u64,
    /// Its log time (0: nothing).
    pub log_time_ns: i64,
}

impl Rebuilt {
    fn empty() -> Self {
        Rebuilt { state: State::new(), seq: 0, log_time_ns: 0 }
    }

    /// SHA-256 of the state's canonical encoding, hex; the encoding is hashed as it is made,
    /// never held whole.
    pub fn state_sha256(&self) -> String {
        let mut hasher = Sha256::new();
        self.state.canonical_encode(&mut |chunk| hasher.update(chunk));
        hex::encode(hasher.finalize())
    }
}

/// Progress of a long fold, reported every [`ReplayConfig::progress_every_events`].
#[derive(Clone, Copy, Debug)]
pub struct ReplayProgress {
    /// The sequence just folded or read.
    pub seq: u64,
    /// Where this run ends.
    pub to_seq: u64,
    /// Events handled by this run so far.
    pub events: u64,
    pub elapsed: Duration,
}

pub type ProgressFn = Arc<dyn Fn(ReplayProgress) + Send + Sync>;

#[derive(Clone)]
pub struct ReplayConfig {
    /// Report progress every this many events (if a reporter is set).
    pub progress_every_events: u64,
    /// Rebuilt states kept to start later rebuilds from (each is a full copy of the state).
    pub snapshots_kept_max: usize,
    /// Forget the fold's change tracking every this many events: it exists for checkpoints, and
    /// unbounded it would grow with every key a long rebuild touched. Forgetting costs a copy of
    /// every changed entry (`State::take_changes`, dropped unencoded), so it is rare.
    pub change_tracking_events_max: u64,
    /// How far (in events) the nearest kept snapshot before a point may be behind it before a
    /// rebuild starts from the runner's checkpoint instead, when the checkpoint lies between the
    /// two ([`Replayer::with_checkpoint`]). Loading the checkpoint costs O(state), folding from
    /// the snapshot O(events): on the scale figure's history (10,000 agents, 100,000 surfaces,
    /// 1.6M events) the load took 4.5–5.2 s and the replay tool folded about 95,000 events a
    /// second, so there the load is worth about half a million events (README, "Figures",
    /// stop 46). A smaller fleet's state loads sooner.
    pub checkpoint_over_snapshot_events_min: u64,
    pub progress: Option<ProgressFn>,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            progress_every_events: 100_000,
            snapshots_kept_max: 4,
            change_tracking_events_max: 1_000_000,
            checkpoint_over_snapshot_events_min: 500_000,
            progress: None,
        }
    }
}

impl std::fmt::Debug for ReplayConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayConfig")
            .field("progress_every_events", &self.progress_every_events)
            .field("snapshots_kept_max", &self.snapshots_kept_max)
            .field("change_tracking_events_max", &self.change_tracking_events_max)
            .field("checkpoint_over_snapshot_events_min", &self.checkpoint_over_snapshot_events_min)
            .finish_non_exhaustive()
    }
}

/// Facts about one agent's cursor on one surface, before a decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CursorFacts {
    pub agent: String,
    pub surface: SurfaceId,
    pub cursor: Option<u64>,
    pub tail: u64,
    /// Rows after the cursor that the fold still keeps, oldest first.
    pub rows_after_cursor: Vec<RowMeta>,
    /// New (foreign) rows after the cursor, as the fold counted them for its verdict (the
    /// agent's own rows are not new to it); for an explanation without a send verdict, the
    /// foreign rows among those kept.
    pub foreign_rows_after_cursor: u64,
}

/// Why the fold decided what it did at one sequence.
#[derive(Clone, Debug)]
pub struct Explanation {
    pub record: StoredRecord,
    pub event_type: String,
    /// The verdict the fold records for it (`None`: none recorded).
    pub verdict: Option<Verdict>,
    /// One sentence per fact, in the order the fold checks them.
    pub facts: Vec<String>,
    /// For sends: the cursor and the rows after it.
    pub cursor: Option<CursorFacts>,
    /// The fold had stopped deciding before this event.
    pub halted: Option<Halt>,
}

/// Reads and rebuilds from one log. Cheap to share; rebuilds run one at a time per call.
pub struct Replayer {
    log: Arc<dyn EventLog>,
    config: ReplayConfig,
    /// Rebuilt states by the sequence they were folded to.
    snapshots: Mutex<BTreeMap<u64, Arc<Rebuilt>>>,
    /// The runner's checkpoint of this log, where a rebuild with no snapshot close enough before
    /// its point starts (see [`Replayer::with_checkpoint`]).
    checkpoint: Option<crate::checkpoint::CheckpointStore>,
}

impl std::fmt::Debug for Replayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer").field("log", &self.log.identity()).finish_non_exhaustive()
    }
}

impl Replayer {
    pub fn new(log: Arc<dyn EventLog>, config: ReplayConfig) -> Self {
        Replayer { log, config, snapshots: Mutex::new(BTreeMap::new()), checkpoint: None }
    }

    /// Starts rebuilds from `checkpoint` (the runner's checkpoint of this log) when it was taken
    /// at or before their point and they have no kept snapshot before the point, or only one
    /// further behind than [`ReplayConfig::checkpoint_over_snapshot_events_min`] and older than
    /// the checkpoint: the state loaded whole from the store, O(state), then the events after
    /// it, instead of every event from the first (or from the far snapshot). A server's first
    /// `Replay.StateAt` (or `Explain`) at the log's head folded its whole history before; points
    /// before the checkpoint still fold from the start. A checkpoint that cannot be used
    /// (another fold version or stream, unreadable, or moved past the point by the time it is
    /// read) is passed over, and the rebuild starts as it would without one.
    pub fn with_checkpoint(mut self, checkpoint: crate::checkpoint::CheckpointStore) -> Self {
        self.checkpoint = Some(checkpoint);
        self
    }

    /// The checkpoint's state as a start for a rebuild to `seq`, when there is one at or before
    /// `seq` and after `after` (see [`Replayer::with_checkpoint`]).
    async fn checkpoint_start(&self, seq: u64, after: u64) -> Result<Option<Rebuilt>, ReplayError> {
        let Some(checkpoint) = self.checkpoint.clone() else { return Ok(None) };
        let stream_identity = self.log.identity();
        let started = Instant::now();
        let seqs = after.saturating_add(1)..=seq;
        let state = match off_the_workers(move || checkpoint.load_whole(&stream_identity, seqs)).await? {
            Ok(Some(state)) => state,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::warn!(error = %e, "the checkpoint cannot be read; the rebuild does not start from it");
                return Ok(None);
            }
        };
        let at = state.meta.applied_seq;
        let Some(record) = self.log.get(at).await? else { return Ok(None) };
        tracing::debug!(
            seq = at,
            load_ms = %format_args!("{:.0}", started.elapsed().as_secs_f64() * 1e3),
            "rebuild starts from the runner's checkpoint"
        );
        Ok(Some(Rebuilt { state, seq: at, log_time_ns: record.timestamp_ns }))
    }

    pub fn log(&self) -> &Arc<dyn EventLog> {
        &self.log
    }

    /// The inclusive sequence range `range` covers now. `from > to` means empty.
    pub async fn resolve(&self, range: LogRange) -> Result<(u64, u64), ReplayError> {
        let last = self.log.last_seq().await?;
        let from = match range.from {
            None => 1,
            Some(LogPoint::Seq(seq)) => seq.max(1),
            Some(LogPoint::TimeNs(t)) => self.first_at_or_after(t, last).await?,
        };
        let to = match range.to {
            None => last,
            Some(LogPoint::Seq(seq)) => seq.min(last),
            Some(LogPoint::TimeNs(t)) => self.first_at_or_after(t.saturating_add(1), last).await? - 1,
        };
        Ok((from, to))
    }

    /// The sequence a state point means: the newest event at or before it. A sequence beyond
    /// the newest event is refused rather than silently clamped.
    pub async fn resolve_point(&self, at: Option<LogPoint>) -> Result<u64, ReplayError> {
        let last = self.log.last_seq().await?;
        match at {
            None => Ok(last),
            Some(LogPoint::Seq(seq)) if seq > last => {
                Err(invalid("at.seq", format!("seq {seq} is beyond the newest event {last}")))
            }
            Some(LogPoint::Seq(seq)) => Ok(seq),
            Some(LogPoint::TimeNs(t)) => Ok(self.first_at_or_after(t.saturating_add(1), last).await? - 1),
        }
    }

    /// The first sequence whose log time is at or after `t` (`last + 1` when none), by binary
    /// search: log times grow with sequences (the embedded log makes them monotonic; JetStream
    /// stamps in order on the stream leader).
    async fn first_at_or_after(&self, t: i64, last: u64) -> Result<u64, ReplayError> {
        let (mut low, mut high) = (1u64, last + 1);
        while low < high {
            let middle = low + (high - low) / 2;
            match self.time_at_or_after(middle, high - 1).await? {
                Some((seq, time)) if time >= t => high = middle.min(seq),
                Some((seq, _)) => low = seq + 1,
                None => high = middle,
            }
        }
        Ok(low)
    }

    /// The first stored event at or after `seq` (up to `bound`) and its log time: sequences
    /// may have gaps where JetStream deleted messages.
    async fn time_at_or_after(&self, seq: u64, bound: u64) -> Result<Option<(u64, i64)>, ReplayError> {
        if let Some(record) = self.log.get(seq).await? {
            return Ok(Some((record.seq, record.timestamp_ns)));
        }
        let mut records = self.log.read(seq, bound, None).await?;
        match records.next().await {
            Some(record) => {
                let record = record?;
                Ok(Some((record.seq, record.timestamp_ns)))
            }
            None => Ok(None),
        }
    }

    fn report(&self, started: Instant, events: u64, seq: u64, to_seq: u64) {
        if let Some(progress) = &self.config.progress {
            if events.is_multiple_of(self.config.progress_every_events.max(1)) {
                progress(ReplayProgress { seq, to_seq, events, elapsed: started.elapsed() });
            }
        }
    }

    /// Stored events of a range, filtered, in log order.
    pub async fn read(
        &self,
        query: ReadQuery,
    ) -> Result<BoxStream<'static, Result<ReplayedEvent, ReplayError>>, ReplayError> {
        let (from, to) = self.resolve(query.range).await?;
        if from > to || query.limit == Some(0) {
            return Ok(stream::empty().boxed());
        }
        let surface_subject = query.filter.surface_subject(self.log.subjects());
        // With verdicts, start from the best snapshot before the range and fold every subject.
        let (fold, read_from, subject) = if query.with_verdicts {
            let start = self.rebuild_owned(from - 1).await?;
            let next = start.seq + 1;
            (Some(start), next, None)
        } else {
            (None, from, surface_subject.clone().map(SubjectFilter))
        };
        let records = self.log.read(read_from, to, subject).await?;
        let cursor = ReadCursor {
            records,
            fold,
            from,
            to,
            filter: query.filter,
            surface_subject,
            remaining: query.limit,
            done: false,
            progress: self.config.progress.clone(),
            progress_every_events: self.config.progress_every_events.max(1),
            change_tracking_events_max: self.config.change_tracking_events_max.max(1),
            events: 0,
            started: Instant::now(),
        };
        Ok(stream::unfold(cursor, |mut cursor| async move {
            let item = cursor.next().await?;
            Some((item, cursor))
        })
        .boxed())
    }

    /// The state as of `at` (the newest event at or before it; `None`: the newest event).
    /// Shared with the snapshot cache: clone it to change it.
    pub async fn rebuild(&self, at: Option<LogPoint>) -> Result<Arc<Rebuilt>, ReplayError> {
        let seq = self.resolve_point(at).await?;
        self.rebuild_to(seq).await
    }

    /// Folds up to `seq`, from the newest snapshot at or before it, and keeps the result as a
    /// snapshot (at most [`ReplayConfig::snapshots_kept_max`], spread over the log).
    ///
    /// A fold past the newest snapshot takes that snapshot over instead of copying it: the state
    /// asked for at the log's head, again and again as the log grows (an operator watching, or
    /// `anima-load`'s reader), then costs the events since the last call, not a copy of the
    /// whole state per call and a cache of several full states. Under `anima-load` with calls
    /// 5 s apart, the engine ended a 90 s run at 1.38 GiB, against 2.36 GiB when every call
    /// copied (README, "Load it").
    async fn rebuild_to(&self, seq: u64) -> Result<Arc<Rebuilt>, ReplayError> {
        let nearest = {
            let snapshots = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
            match snapshots.range(..=seq).next_back() {
                Some((&at, exact)) if at == seq => return Ok(exact.clone()),
                nearest => nearest.map(|(&at, _)| at),
            }
        };
        // The runner's checkpoint, when no snapshot is before `seq` or the nearest is far behind
        // the point (see `ReplayConfig::checkpoint_over_snapshot_events_min`).
        let from_checkpoint = match nearest {
            None => self.checkpoint_start(seq, 0).await?,
            Some(at) if seq - at >= self.config.checkpoint_over_snapshot_events_min => {
                self.checkpoint_start(seq, at).await?
            }
            Some(_) => None,
        };
        // Owned: folded further in place. Shared: to be copied first.
        let start: Result<Rebuilt, Arc<Rebuilt>> = if let Some(start) = from_checkpoint {
            Ok(start)
        } else {
            let mut snapshots = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
            let newest = snapshots.last_key_value().map(|(&at, _)| at);
            match snapshots.range(..=seq).next_back().map(|(&at, _)| at) {
                Some(at) if at == seq => return Ok(snapshots[&at].clone()),
                Some(at) if Some(at) == newest => {
                    let taken = snapshots.remove(&at).expect("the newest snapshot is kept");
                    // Shared with a caller still reading it: it stays kept, and is copied.
                    Arc::try_unwrap(taken).inspect_err(|shared| {
                        snapshots.insert(at, shared.clone());
                    })
                }
                Some(at) => Err(snapshots[&at].clone()),
                None => Ok(Rebuilt::empty()),
            }
        };
        // Copied after the lock is let go: a copy of a whole state takes seconds at a fleet's
        // history, and every other rebuild waits on the lock.
        let start = match start {
            Ok(owned) => owned,
            Err(shared) => owned(shared).await?,
        };
        // A start at `seq` itself is the checkpoint's state (a snapshot at `seq` returned above),
        // kept like a fold's result.
        let rebuilt = Arc::new(if start.seq == seq { start } else { self.fold(start, seq, false, |_, _| {}).await? });
        if seq > 0 && self.config.snapshots_kept_max > 0 {
            let mut forgotten = Vec::new();
            {
                let mut snapshots = self.snapshots.lock().unwrap_or_else(|p| p.into_inner());
                snapshots.insert(seq, rebuilt.clone());
                while snapshots.len() > self.config.snapshots_kept_max {
                    // Keep the spread: forget the snapshot closest to its older neighbour.
                    let keys: Vec<u64> = snapshots.keys().copied().collect();
                    let closest = keys.windows(2).min_by_key(|pair| pair[1] - pair[0]).map(|pair| pair[1]);
                    forgotten.extend(match closest {
                        Some(key) => snapshots.remove(&key),
                        None => snapshots.pop_first().map(|(_, s)| s),
                    });
                }
            }
            if !forgotten.is_empty() {
                free_off_the_workers(forgotten);
            }
        }
        Ok(rebuilt)
    }

    /// [`Replayer::rebuild_to`], owned, to fold further.
    async fn rebuild_owned(&self, seq: u64) -> Result<Rebuilt, ReplayError> {
        owned(self.rebuild_to(seq).await?).await
    }

    /// Folds the events after `rebuilt.seq` up to `to`, calling `visit` after each is applied.
    /// With `track_changes` the fold's change tracking is never forgotten, so the state lists
    /// every key it touched (for [`DirectSource::verify`]).
    async fn fold(
        &self,
        mut rebuilt: Rebuilt,
        to: u64,
        track_changes: bool,
        mut visit: impl FnMut(&StoredRecord, &State) + Send,
    ) -> Result<Rebuilt, ReplayError> {
        let started = Instant::now();
        let mut records = self.log.read(rebuilt.seq + 1, to, None).await?;
        let mut events = 0u64;
        while let Some(record) = records.next().await {
            let record = record?;
            rebuilt.state.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
            rebuilt.seq = record.seq;
            rebuilt.log_time_ns = record.timestamp_ns;
            visit(&record, &rebuilt.state);
            events += 1;
            // Yields to the other tasks of this worker once the task's budget is spent: a fold of
            // a long range must not hold the requests queued behind it.
            tokio::task::consume_budget().await;
            if !track_changes && events.is_multiple_of(self.config.change_tracking_events_max.max(1)) {
                drop(rebuilt.state.take_changes());
            }
            self.report(started, events, record.seq, to);
        }
        // The last events may have been gaps: the state is as of `to` all the same.
        if rebuilt.seq < to {
            rebuilt.seq = to;
        }
        if !track_changes {
            // Nothing reads them, and a kept snapshot would carry them into every later fold.
            drop(rebuilt.state.take_changes());
        }
        Ok(rebuilt)
    }

    /// The facts of the decision at `seq`: the state at `seq − 1` and the verdict the fold
    /// records when it applies `seq`.
    pub async fn explain(&self, seq: u64) -> Result<Explanation, ReplayError> {
        if seq == 0 {
            return Err(invalid("seq", "sequences start at 1"));
        }
        let record = self
            .log
            .get(seq)
            .await?
            .ok_or_else(|| ReplayError::NotFound(format!("seq: no event is stored at seq {seq}")))?;
        let mut before = self.rebuild_owned(seq - 1).await?;
        let event_type = Redactor::schema().event_type(&record.payload);
        let mut explanation = Explanation {
            record: record.clone(),
            event_type,
            verdict: None,
            facts: Vec::new(),
            cursor: None,
            halted: before.state.meta.halted.clone(),
        };
        if let Some(halt) = &explanation.halted {
            explanation.facts.push(format!(
                "the fold stopped deciding at seq {} ({}); nothing after it is decided",
                halt.seq, halt.reason
            ));
        }
        let envelope = proto::Envelope::decode(record.payload.as_ref());
        match &envelope {
            Ok(envelope) => describe_state_before(&before.state, envelope, &mut explanation),
            Err(e) => explanation.facts.push(format!("the event does not decode ({e}): the fold stops here")),
        }
        before.state.apply_bytes(LogPosition { seq, at_ns: record.timestamp_ns }, &record.payload);
        explanation.verdict = before.state.verdict(seq).cloned();
        if let (Ok(envelope), Some(verdict)) = (&envelope, explanation.verdict.clone()) {
            explain_verdict(envelope, &verdict, &mut explanation);
            // The cursor facts count new rows as the fold did: its verdict carries the count.
            if let (Some(cursor), Verdict::Send(send)) = (explanation.cursor.as_mut(), &verdict) {
                cursor.foreign_rows_after_cursor = match send {
                    SendVerdict::Held(held) => held.new_messages,
                    SendVerdict::Allowed { .. } | SendVerdict::NotContacted(_) => 0,
                };
            }
        }
        free_off_the_workers(before);
        Ok(explanation)
    }

    /// Counts and derived figures of the events of `range`, from their redacted views and the
    /// verdicts of a fold (content-free), with the sequence range they cover.
    pub async fn counts(
        &self,
        range: LogRange,
        bucket: TimeBucket,
    ) -> Result<(u64, u64, AnalyticsCounts), ReplayError> {
        let (from, to) = self.resolve(range).await?;
        let mut counts = AnalyticsCounts::new(bucket);
        if from > to {
            return Ok((from, to, counts));
        }
        let start = self.rebuild_owned(from - 1).await?;
        let redactor = Redactor::schema();
        let folded = self
            .fold(start, to, false, |record, state| {
                let mut event = redactor.redact(record.seq, record.timestamp_ns, &record.subject, &record.payload);
                event.outcome = state.verdict(record.seq).map(RedactedOutcome::of);
                counts.observe(&event);
            })
            .await?;
        free_off_the_workers(folded);
        Ok((from, to, counts))
    }
}

/// The state of one `read` stream.
struct ReadCursor {
    records: BoxStream<'static, Result<StoredRecord, LogError>>,
    fold: Option<Rebuilt>,
    from: u64,
    to: u64,
    filter: EventFilter,
    /// The filter's surface as a subject of the log read.
    surface_subject: Option<String>,
    remaining: Option<u64>,
    done: bool,
    progress: Option<ProgressFn>,
    progress_every_events: u64,
    change_tracking_events_max: u64,
    events: u64,
    started: Instant,
}

impl Drop for ReadCursor {
    fn drop(&mut self) {
        if let Some(fold) = self.fold.take() {
            free_off_the_workers(fold);
        }
    }
}

impl ReadCursor {
    async fn next(&mut self) -> Option<Result<ReplayedEvent, ReplayError>> {
        loop {
            if self.done || self.remaining == Some(0) {
                return None;
            }
            let record = match self.records.next().await {
                None => return None,
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e.into()));
                }
                Some(Ok(record)) if record.seq > self.to => return None,
                Some(Ok(record)) => record,
            };
            self.events += 1;
            if let Some(progress) = &self.progress {
                if self.events.is_multiple_of(self.progress_every_events) {
                    progress(ReplayProgress {
                        seq: record.seq,
                        to_seq: self.to,
                        events: self.events,
                        elapsed: self.started.elapsed(),
                    });
                }
            }
            if let Some(fold) = &mut self.fold {
                fold.state.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
                fold.seq = record.seq;
                if self.events.is_multiple_of(self.change_tracking_events_max) {
                    drop(fold.state.take_changes());
                }
                // As in `Replayer::fold`: filtered out, events are folded without an item to
                // give back, so the stream would not yield between them.
                tokio::task::consume_budget().await;
            }
            if record.seq < self.from {
                continue;
            }
            let Some(event_type) = self.filter.matches(&record, self.surface_subject.as_deref()) else { continue };
            let verdict = self.fold.as_ref().and_then(|fold| fold.state.verdict(record.seq).cloned());
            if let Some(remaining) = &mut self.remaining {
                *remaining -= 1;
            }
            return Some(Ok(ReplayedEvent { record, event_type, verdict }));
        }
    }
}

/// What an explanation says of the state before a decision, without deciding anything: for a
/// send, the agent's cursor and the rows after it; for a memory-pass request, the plan the
/// fold's own planning function gives at the request's log time.
fn describe_state_before(state: &State, envelope: &proto::Envelope, explanation: &mut Explanation) {
    match envelope.payload.as_ref() {
        Some(Payload::Send(request)) => {
            if let Some(surface) = request.target.as_ref().and_then(SurfaceId::from_target) {
                explanation.cursor = Some(cursor_facts(state, &request.agent_id, &surface));
            }
        }
        Some(Payload::MemoryPass(request)) => {
            let agent = request.agent_id.as_str();
            let plan = state.memory_plan(explanation.record.timestamp_ns);
            let gate = state.memory_gate(agent);
            let facts = &mut explanation.facts;
            facts.push(format!(
                "{agent}'s gate: newest history at seq {}, newest outcome at seq {} ({})",
                gate.newest_history_seq,
                gate.newest_outcome_seq,
                if gate.eligible() { "eligible" } else { "not eligible" }
            ));
            facts.push(format!(
                "{} memory passes were queued or running; maxConcurrent was {}",
                plan.open, plan.config.max_concurrent
            ));
            match plan.entries.iter().find(|e| e.agent == agent) {
                Some(entry) => facts.push(format!(
                    "at this log time the due pass was {} (slot {}): {} — {}",
                    entry.due.as_ref().map_or("none", |d| d.pass_id.as_str()),
                    entry.due_label,
                    entry.status.as_str(),
                    entry.why
                )),
                None => facts.push(format!("{agent} is neither registered nor in the scope")),
            }
        }
        _ => {}
    }
}

/// The facts of one decision, rendered from the verdict the fold recorded (which carries the
/// facts its decide function used). Nothing here decides again: a rule has one copy, the fold's.
fn explain_verdict(envelope: &proto::Envelope, verdict: &Verdict, explanation: &mut Explanation) {
    let facts = &mut explanation.facts;
    match verdict {
        Verdict::Refused(refusal) => {
            facts.push(format!("refused ({}): {}", refusal_name(refusal.kind), refusal.message));
        }
        Verdict::Send(SendVerdict::Allowed { surface, cursor_before: None, .. }) => {
            let agent = agent_of(envelope);
            facts.push(format!("{agent} has no cursor on {surface}: a send there is allowed without looking at rows"));
        }
        Verdict::Send(SendVerdict::Allowed { surface, cursor_before: Some(before), cursor_after }) => {
            let agent = agent_of(envelope);
            let after = cursor_after.unwrap_or(*before);
            facts.push(format!("{agent}'s cursor on {surface} was {before}; the surface's tail was {after}"));
            if after > *before {
                facts.push(format!(
                    "the {} rows after the cursor are {agent}'s own: the send is allowed and the cursor passes \
                     them to {after}",
                    after - before
                ));
            } else {
                facts.push("no row is after the cursor: the send is allowed".to_owned());
            }
        }
        Verdict::Send(SendVerdict::NotContacted(refused)) => {
            let agent = agent_of(envelope);
            let member = match &refused.dm_member {
                Some(member) => format!("; the DM's other member is {member}"),
                None => String::new(),
            };
            facts.push(match (refused.reason, &refused.user_id) {
                (NotContactedReason::Listed, Some(user)) => format!(
                    "{user} is on the do-not-contact list of the workspace and {agent}'s post to {} would reach them{member}",
                    refused.surface
                ),
                (NotContactedReason::CouldNotVerify, _) => format!(
                    "the workspace has a do-not-contact list and the other member of the DM {} is not known yet, so it cannot be checked",
                    refused.surface
                ),
                (_, _) => "the do-not-contact configuration in the log does not validate: every send is refused".to_owned(),
            });
            facts
                .push(format!("so the send is refused before the hold ({}); no cursor moved", refused.reason.as_str()));
        }
        Verdict::Send(SendVerdict::Held(held)) => {
            let agent = agent_of(envelope);
            facts.push(format!(
                "{agent}'s cursor on {} was {}; the surface's tail was {}",
                held.surface, held.cursor_before, held.tail
            ));
            let shown: Vec<String> =
                held.shown.iter().map(|row| format!("#{} (seq {}, {})", row.ordinal, row.seq, author(row))).collect();
            facts.push(format!(
                "{} foreign rows are after the cursor ({agent}'s own rows there are not new to it); shown: {}{}",
                held.new_messages,
                shown.join(", "),
                if held.omitted > 0 { format!("; {} older ones not shown", held.omitted) } else { String::new() }
            ));
            facts.push(format!(
                "so the {} is held (not sent) and the cursor passes the tail {}",
                held.kind.noun(),
                held.tail
            ));
        }
        Verdict::Started { item_id, coalesced, moved } => {
            facts.push(format!(
                "the start of {item_id} was accepted: every cursor of its plan still was what the claim expected"
            ));
            for cursor in moved {
                facts.push(format!(
                    "{}: the cursor moved from {} to {} (tail {})",
                    cursor.surface,
                    describe(cursor.before),
                    cursor.after,
                    cursor.tail
                ));
            }
            if !coalesced.is_empty() {
                facts.push(format!("settled without a turn, covered by the moved cursors: {}", coalesced.join(", ")));
            }
        }
        Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn }) => {
            facts.push("nothing was claimable".to_owned());
            if !settled_without_turn.is_empty() {
                facts.push(format!(
                    "settled without a turn on the way, their triggers already covered by a cursor: {}",
                    settled_without_turn.join(", ")
                ));
            }
        }
        Verdict::Claim(ClaimVerdict::Claimed(claimed)) => {
            if !claimed.settled_without_turn.is_empty() {
                facts.push(format!(
                    "settled without a turn first, their triggers already covered by a cursor: {}",
                    claimed.settled_without_turn.join(", ")
                ));
            }
            facts.push(format!(
                "{} ({}) was claimed by {}{}; its trigger #{} on {} is after the cursor",
                claimed.item.id,
                claimed.item.reason.as_str(),
                claimed.worker,
                if claimed.item.resume_after_restart { ", resuming after a restart" } else { "" },
                claimed.item.trigger.ordinal,
                claimed.item.trigger_surface
            ));
            for entry in &claimed.plan {
                facts.push(format!(
                    "plan: {} expects cursor {} and moves it to {}",
                    entry.surface,
                    describe(entry.expected),
                    entry.target
                ));
            }
        }
        Verdict::Finished { item_id, requeued, memory_outcome, notice_owed } => {
            facts.push(format!(
                "{item_id} finished{}",
                if *requeued { " as a restart drain: queued again, to resume" } else { "" }
            ));
            if let Some(outcome) = memory_outcome {
                facts.push(format!("a memory pass: outcome {}", outcome.outcome.as_str()));
            }
            if *notice_owed {
                facts.push(
                    "it failed and a person asked for it (a DM or a mention): a failure notice is owed".to_owned(),
                );
            }
        }
        Verdict::HeartbeatRecorded => facts.push("the heartbeat extended the wake's life by log time".to_owned()),
        Verdict::Recovered { item_id, started: true } => facts.push(format!(
            "{item_id} was running with no heartbeat for 30 minutes of log time: queued again, to resume"
        )),
        Verdict::Recovered { item_id, started: false } => {
            facts.push(format!("{item_id} was claimed and not started within its lease: queued again, for any worker"))
        }
        Verdict::Journaled(journal) => {
            match &journal.surface {
                None => facts.push("not observable: recorded, not journaled".to_owned()),
                Some(surface) => facts.push(format!(
                    "journaled on {surface} as #{}{}",
                    journal.ordinal,
                    if journal.duplicate_message { " (a duplicate of that row)" } else { "" }
                )),
            }
            if let Some(route) = &journal.route {
                facts.push(format!("routed for {}: {}", journal.agent, describe_route(route)));
            }
            if !journal.notices_settled.is_empty() {
                facts.push(format!(
                    "the post settled the failure notices owed for: {}",
                    journal.notices_settled.join(", ")
                ));
            }
            match (journal.wake, journal.not_queued) {
                (Some(reason), _) => facts.push(format!("a {} wake was queued", reason.as_str())),
                (None, Some(NotQueued::QueueFull)) => {
                    facts.push("not queued: queue full (the agent was not woken for it)".to_owned())
                }
                (None, Some(NotQueued::Duplicate)) => {
                    facts.push("not queued: the wake is a duplicate of one queued, active or settled".to_owned())
                }
                (None, None) => {}
            }
        }
        Verdict::LinearSession(session) => {
            facts.push(format!(
                "Linear session {} for {}{}",
                session.session,
                session.agent,
                if session.duplicate_receipt { ": a duplicate receipt, the first one won" } else { "" }
            ));
            if let Some(reason) = session.wake {
                facts.push(format!("a {} wake was queued", reason.as_str()));
            }
            if let Some(not_queued) = session.not_queued {
                facts.push(format!("not queued: {}", not_queued.as_str()));
            }
            if !session.removed.is_empty() {
                facts.push(format!("the stop removed: {}", session.removed.join(", ")));
            }
        }
        Verdict::ThreadStopped(stop) => {
            facts.push(format!("Slack thread stop on {} for {}", stop.surface, stop.agent));
            if stop.removed.is_empty() {
                facts.push("the stop removed nothing (no queued input of the thread)".to_owned());
            } else {
                facts.push(format!("the stop removed: {}", stop.removed.join(", ")));
            }
        }
        Verdict::LinearResponse(response) => facts.push(format!(
            "activity {} ({}){}",
            response.activity_id,
            response.state.as_str(),
            if response.repeated { ": the same response was requested before" } else { "" }
        )),
        Verdict::MemoryPassQueued { pass_id, .. } => facts.push(format!("{pass_id} was queued")),
        Verdict::SubscriptionChanged { surface, muted } => {
            facts.push(format!("{surface} is now {}", if *muted { "muted" } else { "unmuted" }))
        }
        Verdict::AgentRegistered => {}
        Verdict::Configured => {
            let what = match envelope.payload.as_ref() {
                Some(proto::envelope::Payload::DoNotContact(config)) => format!(
                    "the do-not-contact lists ({} workspaces, {} people)",
                    config.lists.len(),
                    config.lists.iter().map(|l| l.user_ids.len()).sum::<usize>()
                ),
                Some(proto::envelope::Payload::MemoryConfig(_)) => "the memoryCoherence configuration".to_owned(),
                _ => "the configuration".to_owned(),
            };
            facts.push(format!("{what} replaced the previous one: decisions after this event use it"));
        }
    }
}

/// The agent a request acts for.
fn agent_of(envelope: &proto::Envelope) -> &str {
    match envelope.payload.as_ref() {
        Some(Payload::Send(request)) => &request.agent_id,
        _ => "the agent",
    }
}

fn describe_route(route: &Route) -> String {
    match route {
        Route::Wake(reason) => format!("wake ({})", reason.as_str()),
        Route::Ignored(reason) => format!("ignored ({})", reason.as_str()),
    }
}

fn describe(cursor: Option<u64>) -> String {
    cursor.map_or_else(|| "absent".to_owned(), |c| c.to_string())
}

fn author(row: &RowMeta) -> String {
    match (&row.owner, row.user_id.is_empty()) {
        (Some(owner), _) => format!("agent {owner}"),
        (None, false) => format!("user {}", row.user_id),
        (None, true) => format!("bot {}", row.bot_id),
    }
}

/// The cursor of `agent` on `surface` and the rows after it.
pub fn cursor_facts(state: &State, agent: &str, surface: &SurfaceId) -> CursorFacts {
    let cursor = state.cursor(agent, surface);
    let journal = state.journal(surface);
    let tail = journal.as_ref().map_or(0, |j| j.tail);
    let rows_after_cursor: Vec<RowMeta> = match (journal, cursor) {
        (Some(_), Some(at)) => state.recent_rows(surface).into_iter().filter(|row| row.ordinal > at).collect(),
        _ => Vec::new(),
    };
    let foreign = rows_after_cursor.iter().filter(|row| !row.is_own(agent)).count() as u64;
    CursorFacts {
        agent: agent.to_owned(),
        surface: surface.clone(),
        cursor,
        tail,
        rows_after_cursor,
        foreign_rows_after_cursor: foreign,
    }
}

/// How long [`tap`] waits for the live fold to record an event's verdict before sending the
/// event without it.
pub const TAP_VERDICT_WAIT: Duration = Duration::from_secs(2);

/// Redacted events from `from_seq`, then live: the stream ends only when the log's follow
/// stream does (or the caller drops it). With a live `projection`, each event carries the
/// outcome the live fold recorded, while it still keeps it.
pub async fn tap(
    log: Arc<dyn EventLog>,
    projection: Option<Arc<Projection>>,
    from_seq: u64,
    event_types: BTreeSet<String>,
) -> Result<BoxStream<'static, Result<RedactedEvent, ReplayError>>, ReplayError> {
    let records = log.follow(from_seq.max(1), None).await?;
    let events = records
        .filter_map(move |record| {
            let keep = match &record {
                Ok(record) => {
                    let redactor = Redactor::schema();
                    event_types.is_empty() || event_types.contains(&redactor.event_type(&record.payload))
                }
                Err(_) => true,
            };
            futures::future::ready(keep.then_some(record))
        })
        .then(move |record| {
            let projection = projection.clone();
            async move {
                let record = record?;
                let mut event =
                    Redactor::schema().redact(record.seq, record.timestamp_ns, &record.subject, &record.payload);
                if let Some(projection) = projection {
                    if projection.wait_applied(record.seq, TAP_VERDICT_WAIT).await.is_ok() {
                        event.outcome = projection.state().verdict(record.seq).map(RedactedOutcome::of);
                    }
                }
                Ok(event)
            }
        });
    Ok(events.boxed())
}

use crate::checkpoint::{jetstream_checkpoint_tree, CheckpointDb, EMBEDDED_CHECKPOINT_TREE};

/// A log opened directly, without a server, and the data dir holding its checkpoint (if any).
pub struct DirectSource {
    pub log: Arc<dyn EventLog>,
    /// What was opened, for the operator ("embedded log in ./data", "JetStream stream ANIMA at ...").
    pub description: String,
    checkpoint: Option<StoredCheckpoint>,
}

/// The data dir holding a log's checkpoint: its sled database (held, with its lock, while the
/// source is open), its checkpoint store (`None` when the data dir has none) and the
/// checkpoint's name.
struct StoredCheckpoint {
    _sled: sled::Db,
    store: Option<CheckpointDb>,
    name: String,
}

impl StoredCheckpoint {
    fn open(path: &Path, sled: sled::Db, name: String) -> Result<Self, ReplayError> {
        let store = if CheckpointDb::exists(path) {
            // Only read: the cache is small.
            let store = CheckpointDb::open(path, 16 * 1024 * 1024).map_err(|e| match e {
                crate::checkpoint::CheckpointError::Store(fjall::Error::Locked) => {
                    ReplayError::Locked { path: path.display().to_string() }
                }
                other => ReplayError::Source(format!("{}: {other}", path.display())),
            })?;
            Some(store)
        } else {
            None
        };
        Ok(StoredCheckpoint { _sled: sled, store, name })
    }
}

impl DirectSource {
    /// The checkpoint in the data dir opened with the log, when there is one, for
    /// [`Replayer::with_checkpoint`]: a state asked for at or after it starts there. `None`
    /// when no data dir was opened, or it holds no checkpoint of this log (nothing is created).
    pub fn checkpoint_store(&self) -> Option<crate::checkpoint::CheckpointStore> {
        let stored = self.checkpoint.as_ref()?;
        let db = stored.store.as_ref()?;
        db.existing(&stored.name).ok()??;
        crate::checkpoint::CheckpointStore::open(db, &stored.name).ok()
    }
}

impl std::fmt::Debug for DirectSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectSource").field("description", &self.description).finish_non_exhaustive()
    }
}

/// Opens the sled database of a data dir without creating one.
fn open_data_dir_db(path: &Path) -> Result<sled::Db, ReplayError> {
    if !path.join("db").exists() {
        return Err(ReplayError::Source(format!("{} holds no anima-wake data (no sled database)", path.display())));
    }
    crate::data_dir::open(path, crate::data_dir::SLED_CACHE_BYTES_DEFAULT, false).map_err(|e| match e {
        crate::data_dir::DataDirError::Locked { path } => ReplayError::Locked { path },
        other => ReplayError::Source(other.to_string()),
    })
}

impl DirectSource {
    /// The embedded log of a data dir. Refused with [`ReplayError::Locked`] while a server
    /// holds it. Never creates a log: a data dir without one is an error.
    pub fn open_data_dir(path: impl Into<PathBuf>) -> Result<DirectSource, ReplayError> {
        let path = path.into();
        let db = open_data_dir_db(&path)?;
        if !db.tree_names().iter().any(|name| name.as_ref() == b"log") {
            return Err(ReplayError::Source(format!(
                "{} has no embedded log (was it served with --nats? then replay with --nats)",
                path.display()
            )));
        }
        // Read with the prefix the log holds: the tool needs no setting to read any deployment's.
        let subject_prefix = crate::log::embedded::recorded_subject_prefix(&db)?.unwrap_or_default();
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig { subject_prefix, ..EmbeddedConfig::default() })?;
        Ok(DirectSource {
            log: Arc::new(log),
            description: format!("embedded log in {} (read directly)", path.display()),
            checkpoint: Some(StoredCheckpoint::open(&path, db, EMBEDDED_CHECKPOINT_TREE.to_owned())?),
        })
    }

    /// A JetStream stream, read directly; `data_dir` (optional) holds its checkpoint for
    /// `verify`. Refuses a missing stream instead of creating it. The subject prefix is the one
    /// the stream captures (`config.subject_prefix` is replaced by it), so the tool reads any
    /// deployment's stream by its name alone.
    pub async fn open_jetstream(
        mut config: JetStreamConfig,
        data_dir: Option<&Path>,
    ) -> Result<DirectSource, ReplayError> {
        let client = crate::log::jetstream::connect_client(&config, "anima-wake-replay").await?;
        let context = async_nats::jetstream::new(client);
        match context.get_stream(&config.stream).await {
            Err(e) => {
                return Err(ReplayError::Source(format!(
                    "no JetStream stream {} at {}: {e}",
                    config.stream, config.url
                )))
            }
            Ok(stream) => {
                if let Some(prefix) =
                    crate::log::jetstream::stream_subject_prefix(&stream.cached_info().config.subjects)
                {
                    config.subject_prefix = prefix;
                }
            }
        }
        let checkpoint = match data_dir {
            Some(path) if path.join("db").exists() => {
                Some(StoredCheckpoint::open(path, open_data_dir_db(path)?, jetstream_checkpoint_tree(&config.stream))?)
            }
            _ => None,
        };
        let description = format!("JetStream stream {} at {} (read directly)", config.stream, config.url);
        let log = JetStreamLog::connect(config).await?;
        Ok(DirectSource { log: Arc::new(log), description, checkpoint })
    }

    /// Rebuilds the state from the log up to the checkpoint's applied sequence and compares
    /// it, entry by entry and as canonical bytes, with the checkpoint in the data dir.
    pub async fn verify(&self, config: ReplayConfig) -> Result<VerifyReport, ReplayError> {
        let StoredCheckpoint { store, name: tree_name, .. } = self
            .checkpoint
            .as_ref()
            .ok_or_else(|| ReplayError::Source("no data dir with a checkpoint was opened (pass --data)".to_owned()))?;
        let no_checkpoint = || ReplayError::Source(format!("the data dir has no checkpoint {tree_name}"));
        let store = store.as_ref().ok_or_else(no_checkpoint)?;
        let read_error =
            |e: crate::checkpoint::CheckpointError| ReplayError::Source(format!("reading checkpoint {tree_name}: {e}"));
        let tree = store.existing(tree_name).map_err(read_error)?.ok_or_else(no_checkpoint)?;
        let store_error = |e: fjall::Error| ReplayError::Source(format!("reading checkpoint {tree_name}: {e}"));
        let fold_version = tree
            .get(FOLD_VERSION_KEY)
            .map_err(store_error)?
            .and_then(|v| <[u8; 4]>::try_from(v.as_ref()).ok())
            .map(u32::from_be_bytes);
        let stream = tree.get(STREAM_KEY).map_err(store_error)?.map(|v| String::from_utf8_lossy(&v).into_owned());
        if fold_version != Some(FOLD_VERSION) {
            return Err(ReplayError::Source(format!(
                "the checkpoint was taken by fold version {} and this build folds version {FOLD_VERSION}: a \
                 server would discard it and rebuild, so there is nothing to compare",
                fold_version.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
            )));
        }
        let identity = self.log.identity();
        if stream.as_deref() != Some(identity.as_str()) {
            return Err(ReplayError::Source(format!(
                "the checkpoint was taken on stream {} and this log is {identity}: a server would discard it",
                stream.unwrap_or_else(|| "unknown".to_owned())
            )));
        }
        let mut checkpoint: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::new();
        // Entry by entry, as the state wrote them (slot pages given back one entry each).
        let stored = crate::checkpoint::state_scan(&tree, &[]).map_err(read_error)?;
        checkpoint.extend(stored);
        let mut checkpointed = State::new();
        for (key, value) in &checkpoint {
            if let Err(e) = checkpointed.load_entry(key, value) {
                return Ok(VerifyReport {
                    applied_seq: 0,
                    entries: checkpoint.len() as u64,
                    canonical_equal: false,
                    checkpoint_sha256: String::new(),
                    rebuilt_sha256: String::new(),
                    first_difference: Some(KeyDifference {
                        table: e.table.to_owned(),
                        key: escape(key),
                        checkpoint_bytes: Some(value.len() as u64),
                        rebuilt_bytes: None,
                        first_differing_byte: None,
                        note: format!("the checkpoint entry does not decode: {}", e.reason),
                    }),
                });
            }
        }
        let applied_seq = checkpointed.meta.applied_seq;
        let replayer = Replayer::new(self.log.clone(), config);
        let last = self.log.last_seq().await?;
        if applied_seq > last {
            return Err(ReplayError::Source(format!(
                "the checkpoint says seq {applied_seq} was applied, but the log ends at {last}"
            )));
        }
        // Change tracking kept from the start: the final drain lists every entry.
        let mut rebuilt = replayer.fold(Rebuilt::empty(), applied_seq, true, |_, _| {}).await?;
        let rebuilt_entries: BTreeMap<Vec<u8>, Vec<u8>> =
            rebuilt.state.drain_changes().into_iter().filter_map(|(key, value)| Some((key, value?))).collect();
        let rebuilt_bytes = rebuilt.state.canonical_bytes();
        let checkpoint_bytes = checkpointed.canonical_bytes();
        let keys: BTreeSet<&Vec<u8>> = checkpoint.keys().chain(rebuilt_entries.keys()).collect();
        let first_difference = keys.into_iter().find_map(|key| {
            let (left, right) = (checkpoint.get(key), rebuilt_entries.get(key));
            (left != right).then(|| KeyDifference {
                table: table_name(key),
                key: match rebuilt.state.describe_interned_key(key) {
                    Some(named) => format!("{} = {named}", escape(key)),
                    None => escape(key),
                },
                checkpoint_bytes: left.map(|v| v.len() as u64),
                rebuilt_bytes: right.map(|v| v.len() as u64),
                first_differing_byte: match (left, right) {
                    (Some(l), Some(r)) => {
                        Some(l.iter().zip(r).position(|(a, b)| a != b).unwrap_or(l.len().min(r.len())) as u64)
                    }
                    _ => None,
                },
                note: match (left, right) {
                    (Some(_), None) => "only in the checkpoint".to_owned(),
                    (None, Some(_)) => "missing from the checkpoint".to_owned(),
                    _ => "values differ".to_owned(),
                },
            })
        });
        Ok(VerifyReport {
            applied_seq,
            entries: checkpoint.len() as u64,
            canonical_equal: rebuilt_bytes == checkpoint_bytes,
            checkpoint_sha256: hex::encode(Sha256::digest(&checkpoint_bytes)),
            rebuilt_sha256: hex::encode(Sha256::digest(&rebuilt_bytes)),
            first_difference,
        })
    }
}

/// The outcome of [`DirectSource::verify`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyReport {
    /// The checkpoint's applied sequence: the rebuild folded up to it.
    pub applied_seq: u64,
    /// Entries in the checkpoint.
    pub entries: u64,
    pub canonical_equal: bool,
    pub checkpoint_sha256: String,
    pub rebuilt_sha256: String,
    /// The first key (in key-byte order) whose entry differs.
    pub first_difference: Option<KeyDifference>,
}

impl VerifyReport {
    pub fn passed(&self) -> bool {
        self.canonical_equal && self.first_difference.is_none()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyDifference {
    /// The state table the key belongs to ("cursors", "journals", "meta", ...).
    pub table: String,
    /// The key, tag byte first, with non-printable bytes escaped; for tables keyed by interned
    /// surfaces and agents, followed by ` = ` and the key with those named.
    pub key: String,
    pub checkpoint_bytes: Option<u64>,
    pub rebuilt_bytes: Option<u64>,
    pub first_differing_byte: Option<u64>,
    pub note: String,
}

/// The table a checkpoint key belongs to, named by the state itself: loading the key with an
/// empty value fails, naming the table.
fn table_name(key: &[u8]) -> String {
    match State::new().load_entry(key, &[]) {
        Err(e) if e.table != "?" => e.table.to_owned(),
        _ => format!("table tag {}", key.first().copied().unwrap_or_default()),
    }
}

fn escape(bytes: &[u8]) -> String {
    bytes.escape_ascii().to_string()
}
