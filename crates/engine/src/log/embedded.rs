//! The embedded event log on sled: the same semantics as the JetStream stream in
//! one process, for a single machine, a laptop, tests and the first run.
//!
//! Everything lives in ONE sled tree named `log` (builds before layout 4 also wrote each group
//! commit through a redo record in the tree `log-redo`, [`crate::redo`]). Keys of `log` carry a
//! one-byte prefix:
//!
//! | key | value | why |
//! |---|---|---|
//! | `g` + first seq (u64 BE) | a group of records with consecutive seqs (layout `3`) | the log, in seq order |
//! | `r` + seq (u64 BE) | one record: timestamp, subject, msg id, payload (layouts `1`, `2`) | the log, in seq order |
//! | `x` + name | metadata | stream identity, layout version, subject prefix and encoding |
//!
//! Dedupe: the msg ids of the records inside the dedupe window are kept in memory by the writer
//! thread ([`WindowIds`]), each with the seq of its record, and an id found there is confirmed by
//! reading that record, which holds the whole msg id. Timestamps are strictly monotonic with seq
//! (below), so the records themselves are the expiry order: the writer walks them from the
//! window's first seq and forgets each one that left the window. Nothing of this is written:
//! an append writes its records and nothing else. When the log opens, the index is rebuilt from
//! the records of the window, before the first append is decided (the first append waits for
//! it; a process that only reads never pays for it).
//!
//! Builds before layout `4` kept the index in the tree: `m` + msg id → seq and timestamp, one
//! entry per record and a removal per expired record, with a persisted prune cursor (`x`
//! `prune_from`), and before that a second index, `t` + timestamp + seq. That index was most of
//! the writer's writes and kept growing sled's bookkeeping in memory with the window. A tree
//! that still holds such keys has them removed, some with every group commit, and a layout `3`
//! tree is marked layout `4` when it opens, so a build that would look its ids up in the tree
//! refuses it instead of missing duplicates. A tree of layout `1` or `2` keeps its layout
//! number (it names how its records are stored): a build from before layout `3`, opened on such
//! a tree after this one appended to it, would miss the duplicates of the ids this build
//! appended, for one window.
//!
//! Groups: a tree of layout `3` (every tree this build creates) stores the records of one group
//! commit as few entries: up to [`GROUP_RECORDS_MAX`] records or [`GROUP_BYTES_MAX`] bytes each
//! (a larger record alone). The reason is sled's memory, not its disk: sled 0.34 splits a leaf
//! above 16 entries and keeps bookkeeping in memory for every page it has written, cached or
//! not, so a log of one small entry per record grew the engine's memory with its length (at
//! about 8 records per leaf, appended in order). A read of one seq finds the entry holding it
//! (the last group key at or before it) and decodes that group. Trees of layouts `1` and `2`
//! keep one `r` entry per record, read and written as before.
//!
//! Subjects: a new tree records its subject prefix and the newest subject encoding (layout
//! `2`). A tree of layout `1` was created before either was recorded: it was written with
//! `anima.v1` and the first encoding, and keeps both. Builds that know only layout `1` refuse a
//! layout `2` tree, so no older build writes subjects of the wrong encoding into it. Opening a
//! tree with a prefix other than the one it holds is refused: its stored subjects would no
//! longer match the surfaces' subjects. (The embedded log is never shared, so the prefix cannot
//! collide with another deployment's; it is honoured so both backends store the same subjects.)
//!
//! "Appended" means flushed. One writer thread owns every write: it drains the pending append
//! requests (bounded), writes their records in seq order with plain inserts (not sled's
//! `apply_batch`, which takes sled's process-wide lock exclusively and stalls every other sled
//! operation of the process while it waits for it: see [`crate::redo`]), calls `flush()` once
//! and only then answers every request of the group (group commit). A crash before the flush
//! leaves a prefix of the group's records (sled recovers a prefix of its operations): seqs stay
//! dense, and those records were never acknowledged, which the log's contract allows ("a failed
//! append may still have been stored"); a retry with the same msg id finds them in the dedupe
//! window. Builds before layout 4 wrote each group commit whole through a redo record, because
//! each record came with a msg-id entry that had to land with it; opening the log still
//! completes a group commit such a build left torn, before it reads the tail. No other code path writes or flushes, so
//! there are never concurrent `flush_async` calls (sled 0.34.7 hangs with seven or more
//! concurrent calls, as measured here). The writer publishes the last flushed seq on a `watch` channel; readers never
//! look past it, so nothing unflushed is ever read, and followers wake on it.
//!
//! Timestamps are the writer's wall clock made strictly monotonic (`max(now, last + 1ns)`), so
//! folds see time move forward even when the clock steps back. Reopening recovers the last seq and
//! timestamp from the tree: whatever was acknowledged is there after a crash.
//!
//! sled locks its directory: one process at a time. Open at most one `EmbeddedLog` per `Db`: the
//! single-writer design is what keeps seqs dense.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, BoxStream, Stream, StreamExt};
use tokio::sync::{mpsc, oneshot, watch};

use super::window_ids::{IdPrint, WindowIds, SEQS_KEPT_MAX};

use crate::clock::{Clock, SystemClock};
use crate::redo::{self, Writes};
use crate::subject::{SubjectEncoding, SubjectPrefix, Subjects};

use super::{validate_record, AppendOutcome, AppendRecord, EventLog, LogError, LogResult, StoredRecord, SubjectFilter};

/// Name of the sled tree holding the log; the same `Db` holds its other trees (`log-redo`).
const TREE_NAME: &str = "log";
/// The tree where builds before layout 4 wrote the redo record of the group commit being
/// written; opening the log completes one a crash left there.
const REDO_TREE_NAME: &str = "log-redo";

/// One record per entry (layouts 1 and 2).
const PREFIX_RECORD: u8 = b'r';
/// Groups of records (layout 3).
const PREFIX_GROUP: u8 = b'g';
const PREFIX_MSG_ID: u8 = b'm';
/// The expiry index of builds before the prune cursor (see the module docs): only removed.
const PREFIX_LEGACY_EXPIRY: u8 = b't';
const PREFIX_META: u8 = b'x';

const META_STREAM_ID: &[u8] = b"stream_id";
const META_FORMAT: &[u8] = b"format";
const META_SUBJECT_PREFIX: &[u8] = b"subject_prefix";
const META_SUBJECT_ENCODING: &[u8] = b"subject_encoding";
/// Builds of layout 3: the first seq whose msg id their pruning had not considered yet (u64
/// BE). Removed when the tree is marked layout 4.
const META_PRUNE_FROM: &[u8] = b"prune_from";
/// The key in `log-redo` of the redo record of the group commit an older build was writing
/// ([`crate::redo`]); present only while such a build wrote a group, or after a crash in the
/// middle of one, until the next open completes it.
const META_GROUP_REDO: &[u8] = b"group_redo";
/// Layout of a tree created before subjects were recorded: prefix `anima.v1`, first encoding.
const FORMAT_UNRECORDED_SUBJECTS: &[u8] = b"1";
/// Layout 1 plus the subject prefix and encoding in the metadata; one entry per record.
const FORMAT_RECORDED_SUBJECTS: &[u8] = b"2";
/// Layout 2 with the records grouped (`g` entries), msg ids indexed in the tree (`m` entries).
/// Builds before it refuse a layout `3` tree, so none of them writes `r` entries into it. Marked
/// layout `4` when this build opens it.
const FORMAT_GROUPED_STORED_IDS: &[u8] = b"3";
/// Layout version of the trees this build creates: layout 3 without msg-id entries (the writer
/// keeps the window's ids in memory). A tree written by an unknown layout is refused, never
/// guessed at; builds before this one refuse a layout `4` tree, so none of them looks its msg ids
/// up in a tree that no longer holds them.
const FORMAT_VERSION: &[u8] = b"4";
/// Version byte leading every stored record value (a record's encoding inside a group too).
const RECORD_VERSION: u8 = 1;
/// Version byte leading every group value.
const GROUP_VERSION: u8 = 1;
/// Records one group entry holds at most.
const GROUP_RECORDS_MAX: usize = 64;
/// Encoded bytes one group entry takes before it is closed (a record larger than this is a group
/// of its own). A read of one seq decodes its whole group, so this bounds what a random read costs.
const GROUP_BYTES_MAX: usize = 16 * 1024;

/// Append requests waiting for the writer. Callers wait for room beyond this (backpressure), so
/// memory stays bounded whatever the append rate.
const APPEND_REQUESTS_QUEUED_MAX: usize = 1024;
/// Payload bytes one group commit takes before it stops draining more requests. With
/// `PAYLOAD_BYTES_MAX` records, one write set stays well below memory limits.
const GROUP_COMMIT_BYTES_MAX: usize = 64 * 1024 * 1024;
/// Records one read step scans (matching the filter or not) before yielding, so a filter that
/// matches little never holds a blocking thread for long (a step of 4,096 records of ~230 B takes
/// 0.5–1 ms here: the bench below read 600k records in 73–149 ms). Every step is a task on the
/// blocking pool and a fresh range of the tree. With records sharing their subject's bytes,
/// `EventLog::read` of a 600k-event log was 0.37–0.62 of a raw scan of the same tree with 1,024
/// a step (four runs) and 0.65–0.67 with 4,096 (two runs; `REBUILD_EVENTS=600000 cargo bench -p
/// anima-benches -- rebuild_embedded`, alternated); at 1M events, three runs gave 0.36–0.63.
/// A long read reads one step ahead of its caller ([`ReadState`]), which made the
/// runner's rebuild 5–16% faster (four alternated pairs at 600k and 1M events; README,
/// "Figures", stop 46).
const READ_CHUNK_RECORDS_MAX: usize = 4096;
/// Payload bytes one read step returns before yielding.
const READ_CHUNK_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Records the pruning considers per group commit at least (and, separately, legacy `m` and `t`
/// keys it removes); it also scales with the group size so it keeps pace with appends.
const PRUNE_PER_COMMIT_MIN: usize = 256;
/// A group commit at least this long is logged (debug), with how long its planning and its
/// flush took: every append of the group, and every request behind it, waits for it. Under
/// `anima-load`, when a group was one `apply_batch`, the commits over this bound were at first
/// flushes (`fsync` of the log's file) of 41–81 ms after a batch of under a millisecond; in
/// longer runs, batches of 80–118 ms waiting for sled's process-wide lock (see
/// [`crate::redo`]).
const SLOW_COMMIT: Duration = Duration::from_millis(25);

/// Settings of the embedded log.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// An append whose msg id was stored less than this long ago (log time) is a duplicate.
    /// Default 10 minutes, like the JetStream stream: Slack retries for about 5 minutes.
    pub duplicate_window: Duration,
    /// Records one group commit takes at most (one write set, one `flush`). Larger groups
    /// amortize the flush; the bound keeps one batch's memory and latency in check.
    pub group_commit_records_max: usize,
    /// What records are stamped with (made strictly monotonic). The wall clock unless a test
    /// injects another.
    pub clock: Arc<dyn Clock>,
    /// The first tokens of every subject. A new tree records it; an existing one must hold the
    /// same (see [`recorded_subject_prefix`] to open one with whatever it holds).
    pub subject_prefix: SubjectPrefix,
    /// Read the dedupe window's msg ids as soon as the log opens, on its writer thread, rather
    /// than when the first append arrives: a server's first append after a restart then waits
    /// only for what is left of the read. Off by default, so a process that only reads (the
    /// replay tool) never pays for it.
    pub read_window_at_open: bool,
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        EmbeddedConfig {
            duplicate_window: Duration::from_secs(10 * 60),
            group_commit_records_max: 4096,
            clock: Arc::new(SystemClock),
            subject_prefix: SubjectPrefix::default(),
            read_window_at_open: false,
        }
    }
}

/// The embedded log. Appends go through one writer thread (group commit); reads go to the tree
/// directly, in bounded chunks on the blocking pool.
pub struct EmbeddedLog {
    tree: sled::Tree,
    layout: RecordLayout,
    identity: String,
    subjects: Subjects,
    group_commit_records_max: usize,
    /// `None` only while dropping: dropping the sender is what tells the writer to stop.
    requests: Option<mpsc::Sender<AppendRequest>>,
    /// Last flushed seq, published by the writer.
    last_seq: watch::Receiver<u64>,
    writer: Option<std::thread::JoinHandle<()>>,
    tear_next_group_after: Arc<std::sync::Mutex<Option<usize>>>,
    /// How many msg ids the writer keeps for the dedupe window.
    window_len: Arc<AtomicUsize>,
}

impl std::fmt::Debug for EmbeddedLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedLog")
            .field("identity", &self.identity)
            .field("last_seq", &*self.last_seq.borrow())
            .finish_non_exhaustive()
    }
}

/// One caller's records, answered together once they are flushed.
struct AppendRequest {
    records: Vec<AppendRecord>,
    reply: oneshot::Sender<LogResult<Vec<AppendOutcome>>>,
}

impl EmbeddedLog {
    /// Opens (or creates) the log in the `log` tree of `db` and starts its writer thread.
    ///
    /// The caller opens the `Db` so the same database can hold other trees. On first open a
    /// stream identity (UUIDv7) is created and flushed; on reopen the last seq and timestamp are
    /// recovered from the tree.
    pub fn open(db: sled::Db, config: EmbeddedConfig) -> LogResult<Self> {
        if config.duplicate_window.is_zero() {
            return Err(LogError::Store("embedded log misconfigured: duplicate_window must be positive".into()));
        }
        if config.group_commit_records_max == 0 {
            return Err(LogError::Store(
                "embedded log misconfigured: group_commit_records_max must be at least 1".into(),
            ));
        }
        let tree = db.open_tree(TREE_NAME).map_err(store_error)?;
        let (stream_id, subjects, layout) = open_metadata(&tree, &config.subject_prefix)?;
        let redo_tree = db.open_tree(REDO_TREE_NAME).map_err(store_error)?;
        if let Some(writes) = redo::complete(&tree, &redo_tree, &group_redo_key()).map_err(LogError::Store)? {
            tracing::info!(writes, "completed the group commit a crash interrupted");
        }
        let (last_seq, last_timestamp_ns) = recover_tail(&tree, layout)?;
        let pruning = Pruning::recover(&tree, last_seq)?;
        let window_len = Arc::new(AtomicUsize::new(0));

        let (requests_tx, requests_rx) = mpsc::channel(APPEND_REQUESTS_QUEUED_MAX);
        let (last_seq_tx, last_seq_rx) = watch::channel(last_seq);
        let writer = LogWriter {
            window: WindowIds::default(),
            window_built: false,
            window_len: window_len.clone(),
            tree: tree.clone(),
            layout,
            requests: requests_rx,
            last_seq_tx,
            last_seq,
            last_timestamp_ns,
            duplicate_window_ns: duration_ns(config.duplicate_window),
            group_commit_records_max: config.group_commit_records_max,
            clock: config.clock.clone(),
            pruning,
            failure: None,
            tear_next_group_after: Default::default(),
        };
        let tear_next_group_after = writer.tear_next_group_after.clone();
        let read_window_at_open = config.read_window_at_open;
        let writer = std::thread::Builder::new()
            .name("anima-log-writer".into())
            .spawn(move || writer.run(read_window_at_open))
            .map_err(|e| LogError::Store(format!("cannot start the embedded log writer: {e}")))?;
        tracing::info!(
            stream = %stream_id,
            subjects = %subjects.all(),
            subject_encoding = subjects.encoding().label(),
            layout = ?layout,
            last_seq,
            "embedded log opened"
        );

        Ok(EmbeddedLog {
            tree,
            layout,
            identity: format!("sled:{stream_id}"),
            subjects,
            group_commit_records_max: config.group_commit_records_max,
            requests: Some(requests_tx),
            last_seq: last_seq_rx,
            writer: Some(writer),
            tear_next_group_after,
            window_len,
        })
    }

    /// Records whose msg ids the writer keeps in memory for the dedupe window (0 until the
    /// first append has it read them from the tree).
    pub fn window_ids(&self) -> usize {
        self.window_len.load(Ordering::Relaxed)
    }

    /// Fault injection for tests of a crash: the next group commit writes `writes` of its
    /// writes, then stops as a crash would, and fails its appends (the log then refuses appends
    /// until reopened, as after any failed write).
    pub fn tear_next_group_after(&self, writes: usize) {
        *self.tear_next_group_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(writes);
    }

    /// Hands `records` to the writer; the receiver answers once they are flushed.
    async fn submit(&self, records: Vec<AppendRecord>) -> LogResult<oneshot::Receiver<LogResult<Vec<AppendOutcome>>>> {
        let requests = self.requests.as_ref().ok_or_else(writer_stopped)?;
        let (reply, answer) = oneshot::channel();
        requests.send(AppendRequest { records, reply }).await.map_err(|_| writer_stopped())?;
        Ok(answer)
    }

    fn current_last_seq(&self) -> u64 {
        *self.last_seq.borrow()
    }
}

impl Drop for EmbeddedLog {
    /// Stops the writer cleanly: closing the request channel lets it answer what is queued and
    /// exit; joining makes sure its `Tree` handle is gone before the caller reopens the `Db`.
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(writer) = self.writer.take() {
            if writer.join().is_err() {
                tracing::error!("embedded log writer panicked");
            }
        }
    }
}

#[async_trait::async_trait]
impl EventLog for EmbeddedLog {
    fn identity(&self) -> String {
        self.identity.clone()
    }

    fn subjects(&self) -> &Subjects {
        &self.subjects
    }

    async fn append(&self, record: AppendRecord) -> LogResult<AppendOutcome> {
        validate_record(&record, &self.subjects)?;
        let outcomes = self.submit(vec![record]).await?.await.map_err(|_| writer_stopped())??;
        outcomes.into_iter().next().ok_or_else(|| LogError::Store("embedded log writer answered no outcome".into()))
    }

    async fn append_batch(&self, records: Vec<AppendRecord>) -> LogResult<Vec<AppendOutcome>> {
        for record in &records {
            validate_record(record, &self.subjects)?;
        }
        let total = records.len();
        // Split into group-commit-sized requests and queue them all before waiting: the writer
        // commits them back to back (pipelined), and the channel keeps them in order.
        let mut answers = Vec::new();
        let mut chunk = Vec::new();
        let mut chunk_bytes = 0usize;
        for record in records {
            if !chunk.is_empty()
                && (chunk.len() >= self.group_commit_records_max
                    || chunk_bytes + record.payload.len() > GROUP_COMMIT_BYTES_MAX)
            {
                answers.push(self.submit(std::mem::take(&mut chunk)).await?);
                chunk_bytes = 0;
            }
            chunk_bytes += record.payload.len();
            chunk.push(record);
        }
        if !chunk.is_empty() {
            answers.push(self.submit(chunk).await?);
        }
        let mut outcomes = Vec::with_capacity(total);
        for answer in answers {
            outcomes.extend(answer.await.map_err(|_| writer_stopped())??);
        }
        Ok(outcomes)
    }

    async fn read(
        &self,
        from_seq: u64,
        to_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        if let Some(filter) = &filter {
            filter.validate()?;
        }
        let bound = to_seq.min(self.current_last_seq());
        let state = ReadState::new(self.tree.clone(), self.layout, from_seq, filter);
        let records = stream::unfold(Some(state), move |state| async move {
            let mut state = state?;
            if state.next_seq > bound {
                return None;
            }
            match state.next_chunk(bound).await {
                Ok(chunk) => Some((Ok(chunk), Some(state))),
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(records.flat_map(chunk_records).boxed())
    }

    async fn follow(
        &self,
        from_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>> {
        if let Some(filter) = &filter {
            filter.validate()?;
        }
        let state = ReadState::new(self.tree.clone(), self.layout, from_seq, filter);
        let last_seq = self.last_seq.clone();
        let records = stream::unfold(Some((state, last_seq)), |state| async move {
            let (mut state, mut last_seq) = state?;
            let next_seq = state.next_seq;
            // Wait until the writer has flushed the next seq; an error means it stopped.
            let bound = match last_seq.wait_for(|&last| last >= next_seq).await {
                Ok(last) => *last,
                Err(_) => {
                    return Some((Err(writer_stopped()), None));
                }
            };
            match state.next_chunk(bound).await {
                Ok(chunk) => Some((Ok(chunk), Some((state, last_seq)))),
                Err(e) => Some((Err(e), None)),
            }
        });
        Ok(records.flat_map(chunk_records).boxed())
    }

    async fn get(&self, seq: u64) -> LogResult<Option<StoredRecord>> {
        if seq == 0 || seq > self.current_last_seq() {
            return Ok(None);
        }
        let tree = self.tree.clone();
        let layout = self.layout;
        tokio::task::spawn_blocking(move || -> LogResult<Option<StoredRecord>> {
            let mut found = None;
            visit_records(&tree, layout, seq, seq, |seq, parts, value| {
                found = Some(parts.into_record(seq, value)?);
                Ok(false)
            })?;
            match found {
                Some(record) => Ok(Some(record)),
                None => Err(LogError::Store(format!("record {seq} is missing below the last flushed seq"))),
            }
        })
        .await
        .map_err(|e| LogError::Store(format!("embedded read task failed: {e}")))?
    }

    async fn last_seq(&self) -> LogResult<u64> {
        Ok(self.current_last_seq())
    }
}

/// A chunk's records one by one, moved out of the chunk as they are taken (not collected again
/// into results first: a rebuild reads every record of the log through here), or its error.
fn chunk_records(chunk: LogResult<Vec<StoredRecord>>) -> impl Stream<Item = LogResult<StoredRecord>> {
    match chunk {
        Ok(records) => stream::iter(records.into_iter().map(Ok)).left_stream(),
        Err(e) => stream::iter(std::iter::once(Err(e))).right_stream(),
    }
}

/// Cursor of one `read` or `follow` stream. Holds no sled iterator: every step opens a fresh
/// range on the blocking pool, so nothing sled-owned lives across an await.
struct ReadState {
    tree: sled::Tree,
    layout: RecordLayout,
    next_seq: u64,
    filter: Option<SubjectFilter>,
    /// The step after the one the caller is working through, already reading on the blocking
    /// pool (one step ahead at most, so at most two steps' records are in memory). It starts
    /// when a step ends short of records already flushed, so a long read (a runner's catch-up
    /// or rebuild, a replay) reads the next step while the caller folds this one, as the
    /// JetStream client receives the next messages while they are folded. At the live tail a
    /// step reads all that was flushed and nothing is read ahead. A stream dropped meanwhile
    /// leaves that one step to finish and be thrown away.
    ahead: Option<ReadStep>,
}

type ReadStep = tokio::task::JoinHandle<LogResult<(Vec<StoredRecord>, u64)>>;

impl ReadState {
    fn new(tree: sled::Tree, layout: RecordLayout, from_seq: u64, filter: Option<SubjectFilter>) -> Self {
        ReadState { tree, layout, next_seq: from_seq.max(1), filter, ahead: None }
    }

    /// Reads the next chunk in `next_seq..=bound` and advances past what it scanned. The chunk
    /// may be empty when nothing scanned matched the filter. A step read ahead was started at
    /// `next_seq` with a bound no higher than `bound` (bounds only grow), so what it read is
    /// the start of this chunk's range: it is taken as this chunk.
    async fn next_chunk(&mut self, bound: u64) -> LogResult<Vec<StoredRecord>> {
        let step = match self.ahead.take() {
            Some(step) => step,
            None => self.start_step(bound),
        };
        let (records, next_seq) =
            step.await.map_err(|e| LogError::Store(format!("embedded read task failed: {e}")))??;
        self.next_seq = next_seq;
        if next_seq <= bound {
            self.ahead = Some(self.start_step(bound));
        }
        Ok(records)
    }

    fn start_step(&self, bound: u64) -> ReadStep {
        let tree = self.tree.clone();
        let layout = self.layout;
        let filter = self.filter.clone();
        let from_seq = self.next_seq;
        tokio::task::spawn_blocking(move || read_chunk(&tree, layout, from_seq, bound, filter.as_ref()))
    }
}

/// Scans records `from_seq..=bound` in seq order, at most `READ_CHUNK_RECORDS_MAX` of them or
/// `READ_CHUNK_BYTES_MAX` of matching payload, and returns the matches and the next seq to scan.
/// Seqs are dense, so a gap below `bound` means the tree is damaged: fail closed.
fn read_chunk(
    tree: &sled::Tree,
    layout: RecordLayout,
    from_seq: u64,
    bound: u64,
    filter: Option<&SubjectFilter>,
) -> LogResult<(Vec<StoredRecord>, u64)> {
    // Unfiltered, every record scanned is returned: sized once (a rebuild reads the whole log).
    let scanned_max = usize::try_from(bound.saturating_sub(from_seq).saturating_add(1)).unwrap_or(usize::MAX);
    let mut records = Vec::with_capacity(if filter.is_none() { READ_CHUNK_RECORDS_MAX.min(scanned_max) } else { 0 });
    let mut bytes = 0usize;
    let mut scanned = 0usize;
    let next_seq = visit_records(tree, layout, from_seq, bound, |seq, parts, value| {
        if scanned == READ_CHUNK_RECORDS_MAX || bytes >= READ_CHUNK_BYTES_MAX {
            return Ok(false);
        }
        scanned += 1;
        // Built before the filter looks at it, so its subject is checked to be UTF-8 once; a
        // record the filter leaves out is built and dropped (two reference counts on the
        // entry's bytes, taken and given back).
        let record = parts.into_record(seq, value)?;
        if filter.is_none_or(|filter| filter.matches(&record.subject)) {
            bytes += record.payload.len();
            records.push(record);
        }
        Ok(true)
    })?;
    if next_seq == from_seq && from_seq <= bound {
        return Err(LogError::Store(format!("record {from_seq} is missing below the last flushed seq {bound}")));
    }
    Ok((records, next_seq))
}

/// Hands the stored records `from_seq..=bound` to `visit` in seq order, each with the sled value
/// it was decoded from, until `visit` answers `false` (that record not taken). Returns the seq
/// after the last record taken. Seqs are dense, so a gap below `bound` means the tree is
/// damaged: fail closed.
fn visit_records(
    tree: &sled::Tree,
    layout: RecordLayout,
    from_seq: u64,
    bound: u64,
    mut visit: impl FnMut(u64, RecordParts<'_>, &Bytes) -> LogResult<bool>,
) -> LogResult<u64> {
    let mut expected = from_seq;
    if from_seq > bound {
        return Ok(expected);
    }
    let first_entry = match layout {
        RecordLayout::PerRecord => from_seq,
        // The group holding `from_seq` starts at the last group key at or before it.
        RecordLayout::Grouped => {
            match tree.range(layout.key(0)..=layout.key(from_seq)).next_back().transpose().map_err(store_error)? {
                Some((key, _)) => layout.key_seq(&key)?,
                None => from_seq,
            }
        }
    };
    for entry in tree.range(layout.key(first_entry)..=layout.key(bound)) {
        let (key, value) = entry.map_err(store_error)?;
        // One shared owner for the entry: each record's payload is a slice of it (a group holds
        // up to GROUP_RECORDS_MAX records), not an allocation of its own.
        let value = Bytes::from_owner(value);
        for record in EntryRecords::new(layout, layout.key_seq(&key)?, &value)? {
            let (seq, parts) = record?;
            if seq < from_seq && expected == from_seq {
                continue;
            }
            if seq > bound {
                return Ok(expected);
            }
            if seq != expected {
                return Err(LogError::Store(format!("record {expected} is missing (next stored is {seq})")));
            }
            if !visit(seq, parts, &value)? {
                return Ok(expected);
            }
            expected = seq + 1;
        }
    }
    Ok(expected)
}

/// The writer thread's state. It alone assigns seqs and timestamps and writes the tree.
struct LogWriter {
    /// The msg ids of the records inside the dedupe window; built by [`LogWriter::build_window`]
    /// before the first append is decided.
    window: WindowIds,
    window_built: bool,
    /// `window.len()`, for [`EmbeddedLog::window_ids`].
    window_len: Arc<AtomicUsize>,
    tree: sled::Tree,
    layout: RecordLayout,
    requests: mpsc::Receiver<AppendRequest>,
    last_seq_tx: watch::Sender<u64>,
    /// Last flushed seq and its timestamp.
    last_seq: u64,
    last_timestamp_ns: i64,
    duplicate_window_ns: i64,
    group_commit_records_max: usize,
    clock: Arc<dyn Clock>,
    /// Where the pruning goes on from, as of the last flushed commit.
    pruning: Pruning,
    /// Set when a write or flush failed: the tree's state is then unknown, so every later append
    /// fails closed instead of risking a gap or a reused seq. Reopen to recover.
    failure: Option<String>,
    /// Tests of a crash: the next group commit stops after this many writes.
    tear_next_group_after: Arc<std::sync::Mutex<Option<usize>>>,
}

/// The pruning's position, and what older builds may have left in the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pruning {
    /// The first seq the window holds (the pruning has not considered it yet).
    from_seq: u64,
    /// The tree may still hold `m` keys of an older build.
    legacy_ids: bool,
    /// The tree may still hold `t` keys of an older build.
    legacy_expiry: bool,
}

impl Pruning {
    /// What the tree holds of older builds' indexes; `from_seq` is set by the window's build.
    fn recover(tree: &sled::Tree, last_seq: u64) -> LogResult<Self> {
        let holds = |prefix: u8| -> LogResult<bool> {
            Ok(tree.scan_prefix([prefix]).next().transpose().map_err(store_error)?.is_some())
        };
        Ok(Pruning {
            from_seq: last_seq + 1,
            legacy_ids: holds(PREFIX_MSG_ID)?,
            legacy_expiry: holds(PREFIX_LEGACY_EXPIRY)?,
        })
    }
}

/// What one group commit decided before writing it.
struct PlannedGroup {
    batch: Writes,
    outcomes: Vec<Vec<AppendOutcome>>,
    last_seq: u64,
    last_timestamp_ns: i64,
    /// The msg ids of the records the batch appends, and of those that leave the window.
    ids_stored: Vec<(IdPrint, u64)>,
    ids_removed: Vec<(IdPrint, u64)>,
    /// The pruning's position once the batch is written.
    pruning: Pruning,
}

impl LogWriter {
    /// Runs until every sender is gone (the log was dropped), answering what was queued;
    /// `read_window_at_open`: builds the window before waiting for the first append (see
    /// [`EmbeddedConfig`]).
    fn run(mut self, read_window_at_open: bool) {
        if read_window_at_open {
            self.build_window();
        }
        while let Some(first) = self.requests.blocking_recv() {
            if !self.window_built {
                self.build_window();
            }
            let mut records = first.records.len();
            let mut bytes = payload_bytes(&first.records);
            let mut group = vec![first];
            while records < self.group_commit_records_max && bytes < GROUP_COMMIT_BYTES_MAX {
                match self.requests.try_recv() {
                    Ok(request) => {
                        records += request.records.len();
                        bytes += payload_bytes(&request.records);
                        group.push(request);
                    }
                    Err(_) => break,
                }
            }
            self.commit(group);
        }
        tracing::debug!(last_seq = self.last_seq, "embedded log writer stopped");
    }

    /// Reads the msg ids of the records inside the dedupe window into memory: from the first
    /// record a later append's window can hold to the tail. A tree that cannot be read leaves
    /// the log refusing appends (fail closed: a duplicate could not be recognised).
    fn build_window(&mut self) {
        self.window_built = true;
        let started = std::time::Instant::now();
        let built = first_seq_in_window(
            &self.tree,
            self.layout,
            self.last_seq,
            self.last_timestamp_ns.saturating_sub(self.duplicate_window_ns),
        )
        .and_then(|from_seq| {
            read_window_ids(&self.tree, self.layout, from_seq, self.last_seq, &mut self.window)?;
            Ok(from_seq)
        });
        match built {
            Ok(from_seq) => {
                self.pruning.from_seq = from_seq;
                self.window_len.store(self.window.len(), Ordering::Relaxed);
                tracing::info!(
                    ids = self.window.len(),
                    from_seq,
                    took_ms = started.elapsed().as_secs_f64() * 1e3,
                    "embedded log: read the dedupe window's msg ids"
                );
            }
            Err(e) => {
                tracing::error!(error = %e, "embedded log: cannot read the dedupe window's msg ids; refusing appends");
                self.failure = Some(format!("cannot read the dedupe window's msg ids: {e}"));
            }
        }
    }

    /// One group commit: plan, one write set, one `flush`, then answer everyone.
    fn commit(&mut self, group: Vec<AppendRequest>) {
        let result = match &self.failure {
            Some(failure) => Err(LogError::Store(format!(
                "embedded log failed earlier and refuses appends until reopened: {failure}"
            ))),
            None => self.write_group(&group),
        };
        match result {
            Ok(outcomes) => {
                for (request, outcomes) in group.into_iter().zip(outcomes) {
                    // A caller that stopped waiting is not an error: its records are stored.
                    let _ = request.reply.send(Ok(outcomes));
                }
            }
            Err(e) => {
                let message = e.to_string();
                for request in group {
                    let _ = request.reply.send(Err(LogError::Store(message.clone())));
                }
            }
        }
    }

    fn write_group(&mut self, group: &[AppendRequest]) -> LogResult<Vec<Vec<AppendOutcome>>> {
        let started = std::time::Instant::now();
        let planned = self.plan_group(group)?;
        let planned_at = started.elapsed();
        let records: usize = planned.outcomes.iter().map(Vec::len).sum();
        let tear_after = self.tear_next_group_after.lock().unwrap_or_else(|p| p.into_inner()).take();
        let applied = redo::write_in_order(&self.tree, &planned.batch, tear_after);
        let applied_at = started.elapsed();
        let written = match applied {
            Ok(true) => self.tree.flush().map(|_| ()).map_err(|e| e.to_string()),
            Ok(false) => Err("injected: the group commit was torn".to_string()),
            Err(e) => Err(e.to_string()),
        };
        let took = started.elapsed();
        if took >= SLOW_COMMIT {
            tracing::debug!(
                records,
                flush_ms = (took - applied_at).as_secs_f64() * 1e3,
                plan_ms = planned_at.as_secs_f64() * 1e3,
                commit_ms = took.as_secs_f64() * 1e3,
                "slow group commit"
            );
        }
        if let Err(e) = written {
            let message = format!("sled write failed: {e}");
            tracing::error!(error = %e, "embedded log write failed; refusing further appends");
            self.failure = Some(message.clone());
            return Err(LogError::Store(message));
        }
        for &(print, seq) in &planned.ids_stored {
            self.window.insert(print, seq);
        }
        for &(print, seq) in &planned.ids_removed {
            self.window.remove(print, seq, planned.last_seq);
        }
        self.window_len.store(self.window.len(), Ordering::Relaxed);
        self.pruning = planned.pruning;
        if planned.last_seq != self.last_seq {
            self.last_seq = planned.last_seq;
            self.last_timestamp_ns = planned.last_timestamp_ns;
            self.last_seq_tx.send_replace(self.last_seq);
        }
        Ok(planned.outcomes)
    }

    /// The seq of the stored record with `msg_id` inside the window that starts at
    /// `window_start_ns`, if any: each record the in-memory index names is read and its whole
    /// msg id compared.
    fn stored_in_window(&self, msg_id: &[u8], print: IdPrint, window_start_ns: i64) -> LogResult<Option<u64>> {
        for seq in self.window.candidates(print, self.last_seq) {
            let mut found = false;
            visit_records(&self.tree, self.layout, seq, seq, |_, parts, _| {
                found = parts.msg_id == msg_id && parts.timestamp_ns >= window_start_ns;
                Ok(true)
            })?;
            if found {
                return Ok(Some(seq));
            }
        }
        Ok(None)
    }

    /// Decides every record of the group (new seq or duplicate) and builds the batch; finds the
    /// records that leave the dedupe window with it. Reads the tree; writes nothing.
    fn plan_group(&self, group: &[AppendRequest]) -> LogResult<PlannedGroup> {
        let mut batch = Writes::default();
        let mut outcomes = Vec::with_capacity(group.len());
        // Msg ids stored by this group, so a repeat inside the group is a duplicate too.
        let mut stored_here: HashMap<&[u8], u64> = HashMap::new();
        let mut last_seq = self.last_seq;
        let mut last_timestamp_ns = self.last_timestamp_ns;
        let now_ns = self.clock.now_ns();
        let mut records_total = 0usize;
        let mut ids_stored = Vec::new();
        let mut entries = RecordEntries::new(self.layout);

        for request in group {
            let mut request_outcomes = Vec::with_capacity(request.records.len());
            for record in &request.records {
                records_total += 1;
                let msg_id = record.msg_id.as_bytes();
                if let Some(&seq) = stored_here.get(msg_id) {
                    request_outcomes.push(AppendOutcome::Duplicate { seq });
                    continue;
                }
                let timestamp_ns = now_ns.max(last_timestamp_ns.saturating_add(1));
                let window_start_ns = timestamp_ns.saturating_sub(self.duplicate_window_ns);
                let print = IdPrint::of(msg_id);
                if let Some(seq) = self.stored_in_window(msg_id, print, window_start_ns)? {
                    request_outcomes.push(AppendOutcome::Duplicate { seq });
                    continue;
                }
                last_seq += 1;
                last_timestamp_ns = timestamp_ns;
                entries.push(&mut batch, last_seq, timestamp_ns, record);
                ids_stored.push((print, last_seq));
                stored_here.insert(msg_id, last_seq);
                request_outcomes.push(AppendOutcome::Appended { seq: last_seq });
            }
            outcomes.push(request_outcomes);
        }
        entries.close(&mut batch);

        let (ids_removed, pruning) = self.plan_pruning(
            &mut batch,
            last_seq,
            last_timestamp_ns.max(now_ns).saturating_sub(self.duplicate_window_ns),
            (records_total * 2).max(PRUNE_PER_COMMIT_MIN),
        )?;
        Ok(PlannedGroup { batch, outcomes, last_seq, last_timestamp_ns, ids_stored, ids_removed, pruning })
    }

    /// Considers up to `limit` flushed records from the window's first seq on, and returns those
    /// that left the window (older than `window_start_ns`, or [`SEQS_KEPT_MAX`] or more behind
    /// `last_seq`, the tail once the batch lands) with the pruning's position after them. Also
    /// removes up to `limit` of the `m` and of the expired `t` keys older builds left.
    fn plan_pruning(
        &self,
        batch: &mut Writes,
        last_seq: u64,
        window_start_ns: i64,
        limit: usize,
    ) -> LogResult<(Vec<(IdPrint, u64)>, Pruning)> {
        let mut removed = Vec::new();
        let mut pruning = self.pruning;
        if pruning.from_seq <= self.last_seq {
            pruning.from_seq =
                visit_records(&self.tree, self.layout, pruning.from_seq, self.last_seq, |seq, parts, _| {
                    let left = parts.timestamp_ns < window_start_ns || last_seq - seq >= SEQS_KEPT_MAX;
                    if removed.len() == limit || !left {
                        return Ok(false);
                    }
                    removed.push((IdPrint::of(parts.msg_id), seq));
                    Ok(true)
                })?;
        }
        if pruning.legacy_ids {
            let mut found = 0;
            for entry in self.tree.scan_prefix([PREFIX_MSG_ID]).take(limit) {
                batch.remove(entry.map_err(store_error)?.0.to_vec());
                found += 1;
            }
            pruning.legacy_ids = found == limit;
        }
        if pruning.legacy_expiry {
            let start = [PREFIX_LEGACY_EXPIRY];
            let end = expiry_key(window_start_ns, 0);
            let mut expired = 0;
            for entry in self.tree.range(&start[..]..&end[..]).take(limit) {
                batch.remove(entry.map_err(store_error)?.0.to_vec());
                expired += 1;
            }
            // Fewer than asked for: none is left once this batch lands, unless some have not
            // expired yet.
            if expired < limit {
                let newest = self.tree.scan_prefix(start).next_back().transpose().map_err(store_error)?;
                pruning.legacy_expiry = newest.is_some_and(|(key, _)| key.as_ref() >= &end[..]);
            }
        }
        Ok((removed, pruning))
    }
}

/// A window of at least this many records is read by two threads (see [`read_window_ids`]).
const WINDOW_SPLIT_READ_MIN: u64 = 32_768;

/// Reads the msg ids of the records `from_seq..=last_seq` into `window`, in seq order (the
/// index keeps the oldest seq of a fingerprint first). Reading and decoding the records was
/// about 70% of a full window's read at a restart (6.47M ids in 3.4–3.8 s), so a window of
/// [`WINDOW_SPLIT_READ_MIN`] records or more is read in two halves at once: this thread reads
/// the older half into the index while a helper reads the newer half's ids into a list (16
/// bytes an id until the read ends), which then goes into the index after the older half.
fn read_window_ids(
    tree: &sled::Tree,
    layout: RecordLayout,
    from_seq: u64,
    last_seq: u64,
    window: &mut WindowIds,
) -> LogResult<()> {
    let records = (last_seq + 1).saturating_sub(from_seq);
    if records < WINDOW_SPLIT_READ_MIN {
        read_ids(tree, layout, from_seq, last_seq, |print, seq| window.insert(print, seq))?;
        return Ok(());
    }
    let newer_from = from_seq + records / 2;
    std::thread::scope(|scope| {
        let newer = std::thread::Builder::new()
            .name("anima-log-window".into())
            .spawn_scoped(scope, || -> LogResult<Vec<(IdPrint, u64)>> {
                // Sized for a window of up to about 2M records; a larger one grows the list.
                let mut ids = Vec::with_capacity(((last_seq + 1 - newer_from) as usize).min(1 << 20));
                read_ids(tree, layout, newer_from, last_seq, |print, seq| ids.push((print, seq)))?;
                Ok(ids)
            })
            .map_err(|e| LogError::Store(format!("cannot start the window's reading thread: {e}")))?;
        let older = read_ids(tree, layout, from_seq, newer_from - 1, |print, seq| window.insert(print, seq));
        let newer = newer.join().map_err(|_| LogError::Store("the window's reading thread panicked".into()))?;
        // Dense seqs: the older half ends where the newer one begins.
        let older_end = older?;
        if older_end != newer_from {
            return Err(LogError::Store(format!("record {older_end} is missing below the last seq {last_seq}")));
        }
        for (print, seq) in newer? {
            window.insert(print, seq);
        }
        Ok(())
    })
}

/// Hands `put` the msg id fingerprint and seq of each record `from_seq..=bound`, in seq order;
/// returns the seq after the last record read, as [`visit_records`] does.
fn read_ids(
    tree: &sled::Tree,
    layout: RecordLayout,
    from_seq: u64,
    bound: u64,
    mut put: impl FnMut(IdPrint, u64),
) -> LogResult<u64> {
    visit_records(tree, layout, from_seq, bound, |seq, parts, _| {
        put(IdPrint::of(parts.msg_id), seq);
        Ok(true)
    })
}

/// The first seq at or after which records are at least `window_start_ns` old (`last_seq + 1`
/// when none is) and fewer than [`SEQS_KEPT_MAX`] behind `last_seq`: where a later append's
/// dedupe window can begin, since timestamps grow with seqs. A binary search over the records'
/// timestamps: about 23 reads for 6M records.
fn first_seq_in_window(tree: &sled::Tree, layout: RecordLayout, last_seq: u64, window_start_ns: i64) -> LogResult<u64> {
    let first_stored = match tree.range(layout.key(0)..=layout.key(u64::MAX)).next().transpose().map_err(store_error)? {
        Some((key, _)) => layout.key_seq(&key)?,
        None => return Ok(last_seq + 1),
    };
    let (mut low, mut high) = (first_stored.max((last_seq + 1).saturating_sub(SEQS_KEPT_MAX)), last_seq + 1);
    while low < high {
        let middle = low + (high - low) / 2;
        let mut timestamp_ns = None;
        visit_records(tree, layout, middle, middle, |_, parts, _| {
            timestamp_ns = Some(parts.timestamp_ns);
            Ok(true)
        })?;
        let timestamp_ns = timestamp_ns
            .ok_or_else(|| LogError::Store(format!("record {middle} is missing below the last seq {last_seq}")))?;
        if timestamp_ns >= window_start_ns {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    Ok(low)
}

/// Reads or creates the stream identity and the subjects, and checks the layout version and
/// that the tree holds the configured prefix.
fn open_metadata(tree: &sled::Tree, prefix: &SubjectPrefix) -> LogResult<(String, Subjects, RecordLayout)> {
    let id_key = meta_key(META_STREAM_ID);
    let (subjects, layout) = match recorded_subjects(tree)? {
        Some(recorded) => recorded,
        None => {
            let subjects = Subjects::new(prefix.clone(), SubjectEncoding::NEWEST);
            let mut batch = sled::Batch::default();
            batch.insert(meta_key(META_FORMAT), FORMAT_VERSION);
            batch.insert(id_key.clone(), uuid::Uuid::now_v7().to_string().as_bytes());
            batch.insert(meta_key(META_SUBJECT_PREFIX), prefix.as_str().as_bytes());
            batch.insert(meta_key(META_SUBJECT_ENCODING), subjects.encoding().label().as_bytes());
            tree.apply_batch(batch).map_err(store_error)?;
            tree.flush().map_err(store_error)?;
            (subjects, RecordLayout::Grouped)
        }
    };
    if subjects.prefix() != prefix {
        return Err(LogError::Store(format!(
            "embedded log holds subjects under prefix {}, and the configured subject prefix is {prefix}: \
             configure {} or use another data dir",
            subjects.prefix(),
            subjects.prefix()
        )));
    }
    if tree.get(meta_key(META_FORMAT)).map_err(store_error)?.as_deref() == Some(FORMAT_GROUPED_STORED_IDS) {
        // From now on the msg ids this build appends have no `m` entry: builds that would look
        // them up there must refuse the tree (module docs).
        let mut batch = sled::Batch::default();
        batch.insert(meta_key(META_FORMAT), FORMAT_VERSION);
        batch.remove(meta_key(META_PRUNE_FROM));
        tree.apply_batch(batch).map_err(store_error)?;
        tree.flush().map_err(store_error)?;
        tracing::info!("embedded log: layout 3 marked layout 4 (msg ids kept in memory, not in the tree)");
    }
    let stream_id = tree
        .get(&id_key)
        .map_err(store_error)?
        .ok_or_else(|| LogError::Store("embedded log has no stream identity".into()))?;
    let stream_id = String::from_utf8(stream_id.to_vec())
        .map_err(|_| LogError::Store("embedded log stream identity is not UTF-8".into()))?;
    Ok((stream_id, subjects, layout))
}

/// The subjects a tree holds and how it stores its records; `None` for a new tree. Layout 1
/// predates the subject record: `anima.v1` and the first encoding.
fn recorded_subjects(tree: &sled::Tree) -> LogResult<Option<(Subjects, RecordLayout)>> {
    let Some(format) = tree.get(meta_key(META_FORMAT)).map_err(store_error)? else {
        return Ok(None);
    };
    let layout = match format.as_ref() {
        FORMAT_UNRECORDED_SUBJECTS => return Ok(Some((Subjects::unrecorded(), RecordLayout::PerRecord))),
        FORMAT_RECORDED_SUBJECTS => RecordLayout::PerRecord,
        FORMAT_GROUPED_STORED_IDS | FORMAT_VERSION => RecordLayout::Grouped,
        _ => {
            return Err(LogError::Store(format!(
                "embedded log tree has layout {}, this build reads {}, {}, {} and {}: a newer anima-wake created it",
                crate::validate::echo(&String::from_utf8_lossy(&format)),
                String::from_utf8_lossy(FORMAT_UNRECORDED_SUBJECTS),
                String::from_utf8_lossy(FORMAT_RECORDED_SUBJECTS),
                String::from_utf8_lossy(FORMAT_GROUPED_STORED_IDS),
                String::from_utf8_lossy(FORMAT_VERSION)
            )))
        }
    };
    let text = |name: &[u8]| -> LogResult<String> {
        let value = tree
            .get(meta_key(name))
            .map_err(store_error)?
            .ok_or_else(|| LogError::Store(format!("embedded log has no {} record", String::from_utf8_lossy(name))))?;
        String::from_utf8(value.to_vec())
            .map_err(|_| LogError::Store(format!("embedded log {} is not UTF-8", String::from_utf8_lossy(name))))
    };
    let prefix = text(META_SUBJECT_PREFIX)?;
    let prefix = SubjectPrefix::new(&prefix)
        .map_err(|e| LogError::Store(format!("embedded log subject prefix {}: {e}", crate::validate::echo(&prefix))))?;
    let label = text(META_SUBJECT_ENCODING)?;
    let encoding = SubjectEncoding::from_label(&label).ok_or_else(|| {
        LogError::Store(format!(
            "embedded log records subject encoding {}, which this build does not know: a newer anima-wake created it",
            crate::validate::echo(&label)
        ))
    })?;
    Ok(Some((Subjects::new(prefix, encoding), layout)))
}

/// The subject prefix the embedded log in `db` holds, without creating anything: `None` when
/// `db` has no log. For tools that read an existing log whatever prefix it was written under.
pub fn recorded_subject_prefix(db: &sled::Db) -> LogResult<Option<SubjectPrefix>> {
    if !db.tree_names().iter().any(|name| name.as_ref() == TREE_NAME.as_bytes()) {
        return Ok(None);
    }
    let tree = db.open_tree(TREE_NAME).map_err(store_error)?;
    Ok(recorded_subjects(&tree)?.map(|(subjects, _)| subjects.prefix().clone()))
}

/// The last stored seq and its timestamp (0, 0 when empty).
fn recover_tail(tree: &sled::Tree, layout: RecordLayout) -> LogResult<(u64, i64)> {
    let last = tree.range(layout.key(0)..=layout.key(u64::MAX)).next_back().transpose().map_err(store_error)?;
    let Some((key, value)) = last else {
        return Ok((0, 0));
    };
    let mut tail = None;
    for record in EntryRecords::new(layout, layout.key_seq(&key)?, &value)? {
        let (seq, parts) = record?;
        tail = Some((seq, parts.timestamp_ns));
    }
    tail.ok_or_else(|| LogError::Store("the last entry of the embedded log holds no record".into()))
}

/// How a tree stores its records (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecordLayout {
    /// One `r` entry per record, keyed by its seq (layouts 1 and 2).
    PerRecord,
    /// `g` entries of consecutive records, keyed by the first one's seq (layout 3).
    Grouped,
}

impl RecordLayout {
    fn prefix(self) -> u8 {
        match self {
            RecordLayout::PerRecord => PREFIX_RECORD,
            RecordLayout::Grouped => PREFIX_GROUP,
        }
    }

    /// The key of the entry whose first (or only) record is at `seq`.
    fn key(self, seq: u64) -> [u8; 9] {
        let mut key = [0u8; 9];
        key[0] = self.prefix();
        key[1..].copy_from_slice(&seq.to_be_bytes());
        key
    }

    /// The seq of an entry's first (or only) record.
    fn key_seq(self, key: &[u8]) -> LogResult<u64> {
        match key {
            [prefix, seq @ ..] if *prefix == self.prefix() => {
                seq.try_into().map(u64::from_be_bytes).map_err(|_| LogError::Store("malformed record key".into()))
            }
            _ => Err(LogError::Store("malformed record key".into())),
        }
    }
}

/// The record entries of one group commit, built in the tree's layout.
struct RecordEntries {
    layout: RecordLayout,
    /// The open group: its first seq, its value so far and how many records it holds.
    first_seq: u64,
    value: Vec<u8>,
    records: usize,
}

impl RecordEntries {
    fn new(layout: RecordLayout) -> Self {
        RecordEntries { layout, first_seq: 0, value: Vec::new(), records: 0 }
    }

    /// Adds the record stored at `seq` (seqs given in order, without gaps).
    fn push(&mut self, batch: &mut Writes, seq: u64, timestamp_ns: i64, record: &AppendRecord) {
        if self.layout == RecordLayout::PerRecord {
            let mut value = Vec::with_capacity(encoded_record_len(record));
            encode_record_into(&mut value, timestamp_ns, record);
            batch.insert(self.layout.key(seq), value);
            return;
        }
        let len = encoded_record_len(record);
        if self.records == GROUP_RECORDS_MAX || (self.records > 0 && self.value.len() + 4 + len > GROUP_BYTES_MAX) {
            self.close(batch);
        }
        if self.records == 0 {
            self.first_seq = seq;
            self.value.reserve(1 + 4 + len);
            self.value.push(GROUP_VERSION);
        }
        // validate_record bounds a payload (PAYLOAD_BYTES_MAX) far below u32.
        self.value.extend_from_slice(&(len as u32).to_be_bytes());
        encode_record_into(&mut self.value, timestamp_ns, record);
        self.records += 1;
    }

    /// Writes the open group into `batch`.
    fn close(&mut self, batch: &mut Writes) {
        if self.records > 0 {
            batch.insert(self.layout.key(self.first_seq), std::mem::take(&mut self.value));
            self.records = 0;
        }
    }
}

/// The records of one stored entry in seq order, borrowed from its value.
struct EntryRecords<'a> {
    layout: RecordLayout,
    rest: &'a [u8],
    next_seq: u64,
}

impl<'a> EntryRecords<'a> {
    fn new(layout: RecordLayout, first_seq: u64, value: &'a [u8]) -> LogResult<Self> {
        let rest = match layout {
            RecordLayout::PerRecord => value,
            RecordLayout::Grouped => match value.split_first() {
                Some((&GROUP_VERSION, rest)) if !rest.is_empty() => rest,
                _ => return Err(LogError::Store(format!("the record group at seq {first_seq} is malformed"))),
            },
        };
        Ok(EntryRecords { layout, rest, next_seq: first_seq })
    }
}

impl<'a> Iterator for EntryRecords<'a> {
    type Item = LogResult<(u64, RecordParts<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let seq = self.next_seq;
        let record = match self.layout {
            RecordLayout::PerRecord => std::mem::take(&mut self.rest),
            RecordLayout::Grouped => {
                let len = self.rest.get(..4).and_then(|len| len.try_into().ok()).map(u32::from_be_bytes);
                match len.and_then(|len| self.rest.get(4..4 + len as usize)) {
                    Some(record) => {
                        self.rest = &self.rest[4 + record.len()..];
                        record
                    }
                    None => {
                        self.rest = &[];
                        return Some(Err(malformed_record(seq, "its group is cut short")));
                    }
                }
            }
        };
        self.next_seq += 1;
        Some(decode_record_parts(seq, record).map(|parts| (seq, parts)))
    }
}

/// Key of the legacy expiry index: an order-preserving encoding of a signed timestamp followed
/// by the seq, so a byte-ordered range scan visits msg ids oldest first.
fn expiry_key(timestamp_ns: i64, seq: u64) -> [u8; 17] {
    let mut key = [0u8; 17];
    key[0] = PREFIX_LEGACY_EXPIRY;
    key[1..9].copy_from_slice(&((timestamp_ns as u64) ^ (1 << 63)).to_be_bytes());
    key[9..].copy_from_slice(&seq.to_be_bytes());
    key
}

fn group_redo_key() -> Vec<u8> {
    meta_key(META_GROUP_REDO)
}

fn meta_key(name: &[u8]) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + name.len());
    key.push(PREFIX_META);
    key.extend_from_slice(name);
    key
}

/// Record value: version, timestamp (i64 BE), subject length (u32 BE), subject, msg id length
/// (u16 BE), msg id, payload. The msg id is kept so a damaged index can be rebuilt and so
/// replays can show it.
fn encode_record_into(value: &mut Vec<u8>, timestamp_ns: i64, record: &AppendRecord) {
    let subject = record.subject.as_bytes();
    let msg_id = record.msg_id.as_bytes();
    value.push(RECORD_VERSION);
    value.extend_from_slice(&timestamp_ns.to_be_bytes());
    // validate_record bounds subjects (SUBJECT_BYTES_MAX) and msg ids (256 bytes) far below
    // these widths.
    value.extend_from_slice(&(subject.len() as u32).to_be_bytes());
    value.extend_from_slice(subject);
    value.extend_from_slice(&(msg_id.len() as u16).to_be_bytes());
    value.extend_from_slice(msg_id);
    value.extend_from_slice(&record.payload);
}

/// The length of a record's encoding.
fn encoded_record_len(record: &AppendRecord) -> usize {
    1 + 8 + 4 + record.subject.len() + 2 + record.msg_id.len() + record.payload.len()
}

/// A stored record's fields, borrowed from the sled value, so a filtered read copies only the
/// records it returns.
struct RecordParts<'a> {
    timestamp_ns: i64,
    /// As stored: checked to be UTF-8 once, when the record is built ([`RecordParts::into_record`]).
    /// Checking it in the decode too was a sixth of a read step's instructions.
    subject: &'a [u8],
    /// As stored: only the pruning reads it, as the key of its index entry, so a read does not
    /// check its encoding (checking it was a sixth of a read's instructions).
    msg_id: &'a [u8],
    payload: &'a [u8],
}

impl RecordParts<'_> {
    /// The record, its payload sharing `value` (the stored entry these parts were decoded
    /// from, which holds the payload) instead of a copy: every event the fold applies is read
    /// back through here, and a rebuild reads the whole log.
    fn into_record(self, seq: u64, value: &Bytes) -> LogResult<StoredRecord> {
        // `slice_ref` panics unless the slice lies inside `value`, which it was decoded from.
        let subject = async_nats::Subject::from_utf8(value.slice_ref(self.subject))
            .map_err(|_| malformed_record(seq, "subject is not UTF-8"))?;
        Ok(StoredRecord { seq, subject, timestamp_ns: self.timestamp_ns, payload: value.slice_ref(self.payload) })
    }
}

fn malformed_record(seq: u64, what: &str) -> LogError {
    LogError::Store(format!("record {seq} is malformed: {what}"))
}

fn decode_record_parts(seq: u64, value: &[u8]) -> LogResult<RecordParts<'_>> {
    let malformed = |what: &str| malformed_record(seq, what);
    let mut rest = value;
    let mut take = |len: usize, what: &str| -> LogResult<&[u8]> {
        if rest.len() < len {
            return Err(malformed(what));
        }
        let (head, tail) = rest.split_at(len);
        rest = tail;
        Ok(head)
    };
    if take(1, "version")? != [RECORD_VERSION] {
        return Err(malformed("unknown version"));
    }
    let timestamp_ns = i64::from_be_bytes(take(8, "timestamp")?.try_into().map_err(|_| malformed("timestamp"))?);
    let subject_len =
        u32::from_be_bytes(take(4, "subject length")?.try_into().map_err(|_| malformed("subject length"))?) as usize;
    let subject = take(subject_len, "subject")?;
    let msg_id_len =
        u16::from_be_bytes(take(2, "msg id length")?.try_into().map_err(|_| malformed("msg id length"))?) as usize;
    let msg_id = take(msg_id_len, "msg id")?;
    Ok(RecordParts { timestamp_ns, subject, msg_id, payload: rest })
}

fn payload_bytes(records: &[AppendRecord]) -> usize {
    records.iter().map(|record| record.payload.len()).sum()
}

fn duration_ns(duration: Duration) -> i64 {
    i64::try_from(duration.as_nanos()).unwrap_or(i64::MAX)
}

fn store_error(e: sled::Error) -> LogError {
    LogError::Store(format!("sled: {e}"))
}

fn writer_stopped() -> LogError {
    LogError::Unavailable("the embedded log writer has stopped (log closed or failed)".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn record(subject: &str, msg_id: &str, payload: &'static [u8]) -> AppendRecord {
        AppendRecord { subject: subject.into(), msg_id: msg_id.into(), payload: Bytes::from_static(payload) }
    }

    /// A record's value as trees of layouts 1 and 2 store it, one entry per record.
    fn encode_record(timestamp_ns: i64, record: &AppendRecord) -> Vec<u8> {
        let mut value = Vec::new();
        encode_record_into(&mut value, timestamp_ns, record);
        value
    }

    fn record_key(seq: u64) -> [u8; 9] {
        RecordLayout::PerRecord.key(seq)
    }

    fn decode_record(seq: u64, value: &sled::IVec) -> LogResult<StoredRecord> {
        let value = Bytes::from_owner(value.clone());
        let (seq, parts) = EntryRecords::new(RecordLayout::PerRecord, seq, &value)?.next().expect("one record")?;
        parts.into_record(seq, &value)
    }

    fn entries_with_prefix(tree: &sled::Tree, prefix: u8) -> usize {
        tree.scan_prefix([prefix]).count()
    }

    async fn read_seqs(log: &EmbeddedLog, from: u64, to: u64, filter: Option<SubjectFilter>) -> Vec<u64> {
        log.read(from, to, filter).await.expect("read").map(|r| r.expect("record").seq).collect().await
    }

    /// One group commit of many records, small and large, is stored as few entries, and every
    /// record reads back whole from any seq: one at a time, in ranges starting and ending inside
    /// a group, filtered, and after a reopen, which goes on at the next seq.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_are_stored_in_groups_and_read_back_from_any_seq() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        static LARGE: [u8; GROUP_BYTES_MAX + 100] = [7u8; GROUP_BYTES_MAX + 100];
        let records: Vec<AppendRecord> = (0..300)
            .map(|n| {
                let subject = if n % 3 == 0 { "anima.v1.agent.ada" } else { "anima.v1.config" };
                let payload: &'static [u8] = match n {
                    100 | 101 => &LARGE,
                    n if n % 2 == 0 => b"even",
                    _ => b"odd payload",
                };
                record(subject, &format!("id-{n}"), payload)
            })
            .collect();
        let outcomes = log.append_batch(records.clone()).await.expect("append");
        assert_eq!(outcomes.last(), Some(&AppendOutcome::Appended { seq: 300 }));
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let groups = entries_with_prefix(&tree, PREFIX_GROUP);
        // 64 records a group at most, and the two large ones each alone: at least 7 groups.
        assert!((7..=10).contains(&groups), "{groups} group entries for 300 records");
        assert_eq!(entries_with_prefix(&tree, PREFIX_RECORD), 0, "no entry per record");

        for (n, original) in records.iter().enumerate() {
            let seq = n as u64 + 1;
            let stored = log.get(seq).await.expect("get").expect("stored");
            assert_eq!(
                (stored.seq, stored.subject.as_str(), &stored.payload),
                (seq, original.subject.as_str(), &original.payload)
            );
        }
        assert_eq!(read_seqs(&log, 1, u64::MAX, None).await, (1..=300).collect::<Vec<_>>());
        assert_eq!(read_seqs(&log, 63, 130, None).await, (63..=130).collect::<Vec<_>>());
        let agent: Vec<u64> = (1..=300).filter(|seq| (seq - 1) % 3 == 0 && *seq >= 70).collect();
        assert_eq!(read_seqs(&log, 70, u64::MAX, Some(SubjectFilter("anima.v1.agent.ada".into()))).await, agent);
        let timestamps: Vec<i64> =
            log.read(1, u64::MAX, None).await.expect("read").map(|r| r.expect("record").timestamp_ns).collect().await;
        assert!(timestamps.windows(2).all(|pair| pair[0] < pair[1]), "strictly monotonic");
        assert_eq!(log.get(301).await.expect("get"), None);
        drop(log);

        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        assert_eq!(log.last_seq().await.expect("last"), 300);
        let repeat = log.append(records[299].clone()).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 300 });
        let next = log.append(record("anima.v1.config", "after-reopen", b"x")).await.expect("append");
        assert_eq!(next, AppendOutcome::Appended { seq: 301 });
        let last = log.get(301).await.expect("get").expect("stored");
        assert!(last.timestamp_ns > timestamps[299], "time goes on from the recovered tail");
        assert_eq!(read_seqs(&log, 299, u64::MAX, None).await, [299, 300, 301]);
        drop(log);
    }

    /// A read longer than one read step (`READ_CHUNK_RECORDS_MAX` records) comes back whole and
    /// in order, each record with its own subject and payload: from the first seq, from a seq
    /// inside a group just before a step's end, and filtered. Group commits of odd sizes put the
    /// steps' ends inside groups.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_longer_than_a_step_come_back_whole_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = EmbeddedLog::open(db, EmbeddedConfig::default()).expect("open");
        let total = 2 * READ_CHUNK_RECORDS_MAX + 777;
        let subject_of = |n: usize| {
            if n.is_multiple_of(5) {
                format!("anima.v1.agent.a{}", n % 7)
            } else {
                "anima.v1.config".into()
            }
        };
        let payload_of = |n: usize| Bytes::from(format!("payload {n}"));
        let records: Vec<AppendRecord> = (0..total)
            .map(|n| AppendRecord { subject: subject_of(n), msg_id: format!("id-{n}"), payload: payload_of(n) })
            .collect();
        let mut appended = 0;
        for size in [37, 1_000, 501].into_iter().cycle() {
            let end = (appended + size).min(total);
            log.append_batch(records[appended..end].to_vec()).await.expect("append");
            appended = end;
            if appended == total {
                break;
            }
        }
        let read = |from: u64, filter: Option<SubjectFilter>| {
            let log = &log;
            async move {
                log.read(from, u64::MAX, filter)
                    .await
                    .expect("read")
                    .map(|r| r.expect("record"))
                    .map(|r| (r.seq, r.subject.to_string(), r.payload))
                    .collect::<Vec<_>>()
                    .await
            }
        };
        let expected = |from: u64, keep: &dyn Fn(usize) -> bool| -> Vec<(u64, String, Bytes)> {
            (from as usize - 1..total)
                .filter(|n| keep(*n))
                .map(|n| (n as u64 + 1, subject_of(n), payload_of(n)))
                .collect()
        };
        assert_eq!(read(1, None).await, expected(1, &|_| true));
        let inside = READ_CHUNK_RECORDS_MAX as u64 - 3;
        assert_eq!(read(inside, None).await, expected(inside, &|_| true));
        let filter = SubjectFilter("anima.v1.agent.*".into());
        assert_eq!(read(2, Some(filter)).await, expected(2, &|n| n.is_multiple_of(5)));
    }

    /// A follow stream that starts more than a read step behind the head catches up through
    /// steps read ahead, in order and with nothing twice, and then sees what is appended after
    /// it caught up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follow_from_far_behind_catches_up_in_order_then_sees_new_appends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = EmbeddedLog::open(db, EmbeddedConfig::default()).expect("open");
        let behind = 3 * READ_CHUNK_RECORDS_MAX + 123;
        let payload_of = |n: usize| Bytes::from(format!("payload {n}"));
        let appended = |from: usize, to: usize| -> Vec<AppendRecord> {
            (from..to)
                .map(|n| AppendRecord {
                    subject: "anima.v1.config".into(),
                    msg_id: format!("id-{n}"),
                    payload: payload_of(n),
                })
                .collect()
        };
        for start in (0..behind).step_by(1_000) {
            log.append_batch(appended(start, (start + 1_000).min(behind))).await.expect("append");
        }
        let mut follow = log.follow(1, None).await.expect("follow");
        for n in 0..behind {
            let record = follow.next().await.expect("a record").expect("readable");
            assert_eq!((record.seq, &record.payload), (n as u64 + 1, &payload_of(n)));
        }
        log.append_batch(appended(behind, behind + 10)).await.expect("append after catching up");
        for n in behind..behind + 10 {
            let record = tokio::time::timeout(std::time::Duration::from_secs(10), follow.next())
                .await
                .expect("the new record arrives")
                .expect("a record")
                .expect("readable");
            assert_eq!((record.seq, &record.payload), (n as u64 + 1, &payload_of(n)));
        }
    }

    /// A long read dropped after its first record, while its next step reads ahead, does not
    /// keep the store open: once the log is dropped, the data dir closes and opens again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_dropped_part_way_lets_the_data_dir_close() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = crate::data_dir::open(dir.path(), 8 << 20, true).expect("open the data dir");
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        let records: Vec<AppendRecord> = (0..3 * READ_CHUNK_RECORDS_MAX)
            .map(|n| record("anima.v1.config", &format!("id-{n}"), b"payload"))
            .collect();
        log.append_batch(records).await.expect("append");
        let mut read = log.read(1, u64::MAX, None).await.expect("read");
        assert_eq!(read.next().await.expect("a record").expect("readable").seq, 1);
        drop(read);
        drop(log);
        crate::data_dir::close(db, dir.path(), std::time::Duration::from_secs(10)).expect("the data dir closes");
        let reopened = crate::data_dir::open(dir.path(), 8 << 20, false).expect("the data dir opens again");
        let log = EmbeddedLog::open(reopened, EmbeddedConfig::default()).expect("open again");
        assert_eq!(log.last_seq().await.expect("last seq"), 3 * READ_CHUNK_RECORDS_MAX as u64);
    }

    /// A stored subject that is not UTF-8 (a damaged store) fails the read of its record with an
    /// error naming it, filtered or not (its whole read step fails); the records before it
    /// still read one at a time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stored_subject_that_is_not_utf8_fails_its_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        let records = (0..3).map(|n| record("anima.v1.agent.ada", &format!("id-{n}"), b"payload")).collect();
        log.append_batch(records).await.expect("append");
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let (key, value) = tree.scan_prefix([PREFIX_GROUP]).next().expect("one group").expect("entry");
        // The third record's subject is the group's last; damage its first byte.
        let at = value.windows(b"anima.v1.agent.ada".len()).rposition(|w| w == b"anima.v1.agent.ada").expect("subject");
        let mut damaged = value.to_vec();
        damaged[at] = 0xFF;
        tree.insert(key, damaged).expect("insert");

        let error = log.get(3).await.expect_err("a damaged subject");
        assert!(error.to_string().contains("record 3 is malformed: subject is not UTF-8"), "{error}");
        assert_eq!(log.get(2).await.expect("get").expect("stored").subject.as_str(), "anima.v1.agent.ada");
        for filter in [None, Some(SubjectFilter("anima.v1.agent.*".into()))] {
            let read: Vec<LogResult<StoredRecord>> = log.read(1, u64::MAX, filter).await.expect("read").collect().await;
            assert_eq!(read.len(), 1, "the read step fails as a whole: {read:?}");
            let error = read[0].as_ref().expect_err("a damaged subject");
            assert!(error.to_string().contains("record 3 is malformed: subject is not UTF-8"), "{error}");
        }
    }

    /// The pruning walks the records inside a group: when the window's start falls between two
    /// records of one group, the older ones' msg ids go and the newer ones' stay, and a reopen
    /// reads back into memory only the ids of the window.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pruning_stops_inside_a_group_and_goes_on_from_there() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let start_ns = 1_000 * SECOND_NS;
        let clock = Arc::new(ManualClock::new(start_ns));
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("open");
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let records = (0..10).map(|n| record("anima.v1.config", &format!("g-{n}"), b"x")).collect();
        log.append_batch(records).await.expect("append");
        assert_eq!(entries_with_prefix(&tree, PREFIX_GROUP), 1, "one commit, one group");
        // Seqs 1..=10 are stamped start, start + 1 ns, ...: five of them leave the window.
        clock.set(start_ns + 60 * SECOND_NS + 5);
        log.append(record("anima.v1.config", "later", b"x")).await.expect("append");
        assert_eq!(log.window_ids(), 6, "g-5 to g-9 and the later one");
        let again = log.append(record("anima.v1.config", "g-2", b"x")).await.expect("append");
        assert_eq!(again, AppendOutcome::Appended { seq: 12 }, "an expired id is stored again");
        let repeat = log.append(record("anima.v1.config", "g-7", b"x")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 8 });
        drop(log);
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("reopen");
        let repeat = log.append(record("anima.v1.config", "g-8", b"x")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 9 }, "read back from the records");
        // The window a later append can have starts 60 s before the last record (seq 12): at
        // seq 7, one group's record after where it started before the reopen.
        assert_eq!(log.window_ids(), 6, "the window's records only: seqs 7 to 12");
        clock.set(start_ns + 121 * SECOND_NS);
        log.append(record("anima.v1.config", "last", b"x")).await.expect("append");
        assert_eq!(log.window_ids(), 1, "the rest of the group, then the later records");
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 0, "no msg id is written to the tree");
        drop(log);
    }

    /// A tree of layout 2 (one entry per record) keeps its layout: read, appended to and
    /// reopened as before. A layout this build does not know is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_of_one_entry_per_record_keeps_its_layout() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree(TREE_NAME).expect("tree");
        tree.insert(meta_key(META_FORMAT), FORMAT_RECORDED_SUBJECTS).expect("insert");
        tree.insert(meta_key(META_STREAM_ID), &b"layout-2-stream"[..]).expect("insert");
        tree.insert(meta_key(META_SUBJECT_PREFIX), &b"anima.v1"[..]).expect("insert");
        tree.insert(meta_key(META_SUBJECT_ENCODING), SubjectEncoding::NEWEST.label().as_bytes()).expect("insert");
        for seq in 1..=3u64 {
            let id = format!("old-{seq}");
            tree.insert(record_key(seq), encode_record(seq as i64, &record("anima.v1.config", &id, b"old")))
                .expect("insert");
            legacy_msg_id_entry(&tree, &id, seq, seq as i64);
        }
        tree.flush().expect("flush");

        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        assert_eq!(log.identity(), "sled:layout-2-stream");
        let records = (0..100).map(|n| record("anima.v1.config", &format!("new-{n}"), b"new")).collect();
        let outcomes = log.append_batch(records).await.expect("append");
        assert_eq!(outcomes[0], AppendOutcome::Appended { seq: 4 });
        let repeat = log.append(record("anima.v1.config", "new-5", b"new")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 9 });
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 0, "the older build's msg-id entries are gone");
        assert_eq!(entries_with_prefix(&tree, PREFIX_RECORD), 103);
        assert_eq!(entries_with_prefix(&tree, PREFIX_GROUP), 0);
        assert_eq!(read_seqs(&log, 2, 5, None).await, [2, 3, 4, 5]);
        assert_eq!(log.get(2).await.expect("get").expect("stored").payload, Bytes::from_static(b"old"));
        drop(log);
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        assert_eq!(log.last_seq().await.expect("last"), 103);
        drop(log);
        assert_eq!(tree.get(meta_key(META_FORMAT)).expect("get").as_deref(), Some(FORMAT_RECORDED_SUBJECTS));

        tree.insert(meta_key(META_FORMAT), &b"9"[..]).expect("insert");
        let refused = EmbeddedLog::open(db, EmbeddedConfig::default()).expect_err("an unknown layout");
        assert!(refused.to_string().contains("layout \"9\""), "{refused}");
    }

    #[test]
    fn record_encoding_round_trips() {
        let original = record("anima.v1.config", "id-1", b"payload");
        let value = encode_record(42, &original);
        let decoded = decode_record(7, &sled::IVec::from(value.clone())).expect("decodes");
        assert_eq!(decoded.seq, 7);
        assert_eq!(decoded.timestamp_ns, 42);
        assert_eq!(decoded.subject.as_str(), original.subject);
        assert_eq!(decoded.payload, original.payload);
        assert!(decode_record(7, &sled::IVec::from(&value[..5])).is_err());
    }

    #[test]
    fn expiry_keys_sort_by_time_then_seq() {
        assert!(expiry_key(-1, 9) < expiry_key(0, 0));
        assert!(expiry_key(5, 9) < expiry_key(6, 0));
        assert!(expiry_key(5, 1) < expiry_key(5, 2));
    }

    const SECOND_NS: i64 = 1_000_000_000;

    fn manual_config(clock: &Arc<ManualClock>) -> EmbeddedConfig {
        EmbeddedConfig { duplicate_window: Duration::from_secs(60), clock: clock.clone(), ..EmbeddedConfig::default() }
    }

    /// The `m` entry builds of layouts 1 to 3 wrote for each msg id.
    fn legacy_msg_id_entry(tree: &sled::Tree, msg_id: &str, seq: u64, timestamp_ns: i64) {
        let mut key = vec![PREFIX_MSG_ID];
        key.extend_from_slice(msg_id.as_bytes());
        let mut value = [0u8; 16];
        value[..8].copy_from_slice(&seq.to_be_bytes());
        value[8..].copy_from_slice(&timestamp_ns.to_be_bytes());
        tree.insert(key, &value[..]).expect("insert");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn expired_msg_ids_are_pruned_and_can_be_stored_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let clock = Arc::new(ManualClock::new(1_000 * SECOND_NS));
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("open");
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let first = log.append(record("anima.v1.config", "same", b"a")).await.expect("append");
        assert_eq!(first, AppendOutcome::Appended { seq: 1 });
        log.append(record("anima.v1.config", "other", b"a")).await.expect("append");
        clock.advance(Duration::from_secs(59));
        let again = log.append(record("anima.v1.config", "same", b"a")).await.expect("append");
        assert_eq!(again, AppendOutcome::Duplicate { seq: 1 }, "inside the window");
        clock.advance(Duration::from_secs(2));
        let later = log.append(record("anima.v1.config", "same", b"b")).await.expect("append");
        assert_eq!(later, AppendOutcome::Appended { seq: 3 });
        assert_eq!(log.window_ids(), 1, "seqs 1 and 2 left the window; seq 3 holds the id now");
        let repeat = log.append(record("anima.v1.config", "same", b"c")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 3 }, "the newer record, not the expired one");
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 0, "no msg-id entry is written");
        assert_eq!(entries_with_prefix(&tree, PREFIX_LEGACY_EXPIRY), 0, "no expiry index is written");
        assert!(tree.get(meta_key(META_PRUNE_FROM)).expect("get").is_none(), "no prune cursor is written");

        // Reopened, the log reads the window's ids back from the records: seq 3 is still a
        // duplicate until it expires.
        drop(log);
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("reopen");
        assert_eq!(log.window_ids(), 0, "read at the first append, not at open");
        let repeat = log.append(record("anima.v1.config", "same", b"d")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 3 });
        assert_eq!(log.window_ids(), 1);
        drop(log);
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("reopen");
        clock.advance(Duration::from_secs(61));
        let newer = log.append(record("anima.v1.config", "same", b"e")).await.expect("append");
        assert_eq!(newer, AppendOutcome::Appended { seq: 4 });
        assert_eq!(log.window_ids(), 1, "only seq 4 is read back or kept");
        drop(log);
    }

    /// A tree as builds before the prune cursor left it: every record with a msg-id entry and
    /// an expiry key, the oldest already pruned. This build dedupes against its records,
    /// removes every msg-id entry and each expiry key once it expires.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_with_the_older_expiry_index_is_pruned_and_loses_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let clock = Arc::new(ManualClock::new(1_000 * SECOND_NS));
        drop(EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("create"));
        let tree = db.open_tree(TREE_NAME).expect("tree");
        // Those builds wrote one entry per record (layout 2).
        tree.insert(meta_key(META_FORMAT), FORMAT_RECORDED_SUBJECTS).expect("insert");
        // Seqs 1..=4 a second apart; seq 1 was pruned already (no msg-id entry, no expiry key).
        for seq in 1..=4u64 {
            let timestamp_ns = 1_000 * SECOND_NS + seq as i64 * SECOND_NS;
            let id = format!("old-{seq}");
            tree.insert(record_key(seq), encode_record(timestamp_ns, &record("anima.v1.config", &id, b"x")))
                .expect("insert");
            if seq > 1 {
                legacy_msg_id_entry(&tree, &id, seq, timestamp_ns);
                tree.insert(&expiry_key(timestamp_ns, seq)[..], id.as_bytes()).expect("insert");
            }
        }
        tree.flush().expect("flush");

        clock.set(1_005 * SECOND_NS);
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("open");
        let repeat = log.append(record("anima.v1.config", "old-3", b"x")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 3 }, "older ids still dedupe");
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 0, "the msg-id entries go at the first commit");
        assert_eq!(entries_with_prefix(&tree, PREFIX_LEGACY_EXPIRY), 3, "no expiry key has expired yet");
        // Seqs 2 and 3 expire; 4 and the new one do not.
        clock.set(1_063 * SECOND_NS + SECOND_NS / 2);
        log.append(record("anima.v1.config", "new-5", b"x")).await.expect("append");
        assert_eq!(log.window_ids(), 2, "old-4 and new-5");
        assert_eq!(entries_with_prefix(&tree, PREFIX_LEGACY_EXPIRY), 1, "seq 4's expiry key has not expired");
        let repeat = log.append(record("anima.v1.config", "old-4", b"x")).await.expect("append");
        assert_eq!(repeat, AppendOutcome::Duplicate { seq: 4 });
        clock.set(1_070 * SECOND_NS);
        log.append(record("anima.v1.config", "new-6", b"x")).await.expect("append");
        assert_eq!(log.window_ids(), 2, "new-5 and new-6");
        assert_eq!(entries_with_prefix(&tree, PREFIX_LEGACY_EXPIRY), 0);
        drop(log);
    }

    /// A tree of layout 3 (groups, with an `m` entry per msg id and a prune cursor) is marked
    /// layout 4 when it opens, before anything is appended without an `m` entry, so the builds
    /// that would look ids up there refuse it; its ids still dedupe and its entries go.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_of_layout_3_is_marked_layout_4_and_loses_its_msg_id_entries() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let clock = Arc::new(ManualClock::new(1_000 * SECOND_NS));
        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("create");
        let records = (0..300).map(|n| record("anima.v1.config", &format!("id-{n}"), b"x")).collect();
        log.append_batch(records).await.expect("append");
        drop(log);
        let tree = db.open_tree(TREE_NAME).expect("tree");
        tree.insert(meta_key(META_FORMAT), FORMAT_GROUPED_STORED_IDS).expect("insert");
        tree.insert(meta_key(META_PRUNE_FROM), &1u64.to_be_bytes()[..]).expect("insert");
        for n in 0..300u64 {
            legacy_msg_id_entry(&tree, &format!("id-{n}"), n + 1, 1_000 * SECOND_NS + n as i64);
        }
        tree.flush().expect("flush");

        let log = EmbeddedLog::open(db.clone(), manual_config(&clock)).expect("open");
        assert_eq!(tree.get(meta_key(META_FORMAT)).expect("get").as_deref(), Some(FORMAT_VERSION));
        assert!(tree.get(meta_key(META_PRUNE_FROM)).expect("get").is_none());
        let outcomes = log
            .append_batch(vec![record("anima.v1.config", "id-299", b"x"), record("anima.v1.config", "new", b"x")])
            .await
            .expect("append");
        assert_eq!(outcomes, [AppendOutcome::Duplicate { seq: 300 }, AppendOutcome::Appended { seq: 301 }]);
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 300 - PRUNE_PER_COMMIT_MIN, "some go with each commit");
        log.append(record("anima.v1.config", "newer", b"x")).await.expect("append");
        assert_eq!(entries_with_prefix(&tree, PREFIX_MSG_ID), 0);
        assert_eq!(log.window_ids(), 302);
        drop(log);
    }

    /// Appends the ids `id-000000` on, `total` of them, one record each, in batches of 5,000,
    /// through a log that is closed again; returns the ids.
    async fn store_ids(db: &sled::Db, total: usize) -> Vec<String> {
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        let ids: Vec<String> = (0..total).map(|n| format!("id-{n:06}")).collect();
        for chunk in ids.chunks(5_000) {
            let records = chunk.iter().map(|id| record("anima.v1.config", id, b"x")).collect();
            log.append_batch(records).await.expect("append");
        }
        ids
    }

    /// Reopened on many more msg ids than one group commit takes, the log answers repeats as
    /// duplicates and new ids as appended from its first append on, and keeps one id per record
    /// of the window.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn msg_ids_are_deduplicated_after_a_reopen_from_the_records_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let total = 51_217;
        let ids = store_ids(&db, total).await;
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        // From the first append on: a repeat from the end of the log, one from its start, and a
        // new id.
        let interleaved = 500;
        for n in 0..interleaved {
            let repeat = &ids[total - 1 - n];
            let outcomes = log
                .append_batch(vec![
                    record("anima.v1.config", repeat, b"x"),
                    record("anima.v1.config", &ids[n], b"x"),
                    record("anima.v1.config", &format!("new-{n:06}"), b"y"),
                ])
                .await
                .expect("append");
            assert_eq!(outcomes[0], AppendOutcome::Duplicate { seq: (total - n) as u64 }, "repeat of {repeat}");
            assert_eq!(outcomes[1], AppendOutcome::Duplicate { seq: (n + 1) as u64 });
            assert_eq!(outcomes[2], AppendOutcome::Appended { seq: (total + n + 1) as u64 });
        }
        // Every other stored id, repeated: all duplicates, nothing appended.
        let rest: Vec<AppendRecord> =
            ids[interleaved..total - interleaved].iter().map(|id| record("anima.v1.config", id, b"x")).collect();
        let outcomes = log.append_batch(rest).await.expect("append");
        assert!(outcomes.iter().all(|o| matches!(o, AppendOutcome::Duplicate { .. })), "every repeat is a duplicate");
        assert_eq!(log.window_ids(), total + interleaved, "one id per record");
        drop(log);
    }

    /// Opened to read its window at once, the log reads the window's ids before any append,
    /// and they dedupe from the first append on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_log_told_to_read_its_window_at_open_reads_it_before_any_append() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let total = WINDOW_SPLIT_READ_MIN as usize + 1_000;
        store_ids(&db, total).await;
        let config = EmbeddedConfig { read_window_at_open: true, ..EmbeddedConfig::default() };
        let log = EmbeddedLog::open(db.clone(), config).expect("reopen");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while log.window_ids() < total {
            assert!(std::time::Instant::now() < deadline, "{} of {total} ids read, no append made", log.window_ids());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let outcomes = log
            .append_batch(vec![record("anima.v1.config", "id-000000", b"x"), record("anima.v1.config", "new", b"y")])
            .await
            .expect("append");
        let next = total as u64 + 1;
        assert_eq!(outcomes, vec![AppendOutcome::Duplicate { seq: 1 }, AppendOutcome::Appended { seq: next }]);
    }

    /// A window read in two halves (one of them on a helper thread) still fails closed on a
    /// tree that lost records where its older half ends: the first append after the reopen is
    /// refused, never decided on an index with a hole in it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_window_missing_records_where_its_halves_meet_refuses_appends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let total = 2 * WINDOW_SPLIT_READ_MIN + 100;
        store_ids(&db, total as usize).await;
        // The group entry holding the last record of the older half (seqs 1..=total/2).
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let layout = RecordLayout::Grouped;
        let (key, _) = tree.range(layout.key(0)..=layout.key(total / 2)).next_back().expect("a group").expect("read");
        let first = layout.key_seq(&key).expect("group key");
        assert!(first > 1 && first <= total / 2, "a group inside the older half, starting at {first}");
        tree.remove(key).expect("remove");
        tree.flush().expect("flush");

        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        let refused = log.append_batch(vec![record("anima.v1.config", "new", b"y")]).await;
        let refused = refused.expect_err("a damaged window refuses appends");
        // Whichever half reaches the hole first names its first missing record.
        let missing: u64 = refused
            .to_string()
            .split("record ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|seq| seq.parse().ok())
            .unwrap_or_else(|| panic!("no missing record named: {refused}"));
        assert!(missing >= first && missing <= total / 2 + 1, "missing {missing}, group from {first}: {refused}");
        assert_eq!(log.window_ids(), 0);
    }

    /// A hole that ends exactly where the window's newer half begins leaves both halves whole
    /// in themselves: only the check that the older half ended where the newer one begins sees
    /// it, and the first append is refused.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hole_ending_where_the_newer_half_begins_refuses_appends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        // One append of a group's worth of records at a time: one group entry each, so group
        // entries begin at seqs 1, 65, 129, … and one begins where the newer half does.
        let groups = 2 * (WINDOW_SPLIT_READ_MIN as usize).div_ceil(2 * GROUP_RECORDS_MAX);
        let total = (groups * GROUP_RECORDS_MAX) as u64;
        let newer_from = 1 + total / 2;
        {
            let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
            for group in 0..groups {
                let records = (0..GROUP_RECORDS_MAX)
                    .map(|n| record("anima.v1.config", &format!("id-{group}-{n}"), b"x"))
                    .collect();
                log.append_batch(records).await.expect("append");
            }
        }
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let layout = RecordLayout::Grouped;
        assert!(tree.get(layout.key(newer_from)).expect("read").is_some(), "a group begins at {newer_from}");
        let hole = newer_from - GROUP_RECORDS_MAX as u64;
        assert!(tree.remove(layout.key(hole)).expect("remove").is_some(), "the group before it begins at {hole}");
        tree.flush().expect("flush");

        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        let refused = log.append_batch(vec![record("anima.v1.config", "new", b"y")]).await;
        let refused = refused.expect_err("a damaged window refuses appends");
        assert!(refused.to_string().contains(&format!("record {hole} is missing")), "{refused}");
    }

    /// A tree as builds before the subject record left it: layout 1, a record on a subject of
    /// the first encoding.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tree_from_before_the_subject_record_keeps_the_first_encoding() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let tree = db.open_tree(TREE_NAME).expect("tree");
        tree.insert(meta_key(META_FORMAT), FORMAT_UNRECORDED_SUBJECTS).expect("insert");
        tree.insert(meta_key(META_STREAM_ID), &b"old-stream"[..]).expect("insert");
        let old = record("anima.v1.agent.ada_5Fbot", "old", b"old");
        tree.insert(record_key(1), encode_record(1, &old)).expect("insert");
        tree.flush().expect("flush");
        drop(tree);

        assert_eq!(recorded_subject_prefix(&db).expect("read"), Some(SubjectPrefix::default()));
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        assert_eq!(log.subjects(), &Subjects::unrecorded());
        let subject = log.subjects().agent("ada_bot");
        assert_eq!(subject, old.subject, "new events of the agent share the old events' subject");
        let appended = log.append(record(&subject, "new", b"new")).await.expect("append");
        assert_eq!(appended, AppendOutcome::Appended { seq: 2 });
        let filtered: Vec<u64> = log
            .read(1, u64::MAX, Some(SubjectFilter(subject)))
            .await
            .expect("read")
            .map(|r| r.expect("record").seq)
            .collect()
            .await;
        assert_eq!(filtered, [1, 2]);
        drop(log);
        // Opening it again does not rewrite it under the newer layout.
        let tree = db.open_tree(TREE_NAME).expect("tree");
        assert_eq!(tree.get(meta_key(META_FORMAT)).expect("get").as_deref(), Some(FORMAT_UNRECORDED_SUBJECTS));
        // Its prefix is anima.v1, and another one is refused.
        let acme = EmbeddedConfig { subject_prefix: SubjectPrefix::new("acme").expect("prefix"), ..Default::default() };
        let refused = EmbeddedLog::open(db, acme).expect_err("another prefix");
        assert!(refused.to_string().contains("prefix anima.v1"), "{refused}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_new_tree_records_its_prefix_and_the_newest_encoding() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        assert_eq!(recorded_subject_prefix(&db).expect("read"), None);
        let acme = SubjectPrefix::new("acme.anima").expect("prefix");
        let config = EmbeddedConfig { subject_prefix: acme.clone(), ..EmbeddedConfig::default() };
        let log = EmbeddedLog::open(db.clone(), config.clone()).expect("open");
        assert_eq!(log.subjects(), &Subjects::newest(acme.clone()));
        let subject = log.subjects().agent("ada_bot");
        assert_eq!(subject, "acme.anima.agent.ada_bot");
        log.append(record(&subject, "e1", b"x")).await.expect("append");
        let outside = log.append(record("anima.v1.agent.ada_bot", "e2", b"x")).await;
        assert!(matches!(outside, Err(LogError::Invalid(_))), "{outside:?}");
        drop(log);
        assert_eq!(recorded_subject_prefix(&db).expect("read"), Some(acme));
        let refused = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect_err("the default prefix");
        assert!(refused.to_string().contains("acme.anima"), "{refused}");
        let reopened = EmbeddedLog::open(db, config).expect("the same prefix");
        assert_eq!(reopened.subjects().agent("ada_bot"), subject);
    }

    #[test]
    fn refuses_nonsense_configuration() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let zero_window = EmbeddedConfig { duplicate_window: Duration::ZERO, ..EmbeddedConfig::default() };
        assert!(matches!(EmbeddedLog::open(db.clone(), zero_window), Err(LogError::Store(_))));
        let zero_group = EmbeddedConfig { group_commit_records_max: 0, ..EmbeddedConfig::default() };
        assert!(matches!(EmbeddedLog::open(db, zero_group), Err(LogError::Store(_))));
    }

    /// A group commit torn by a crash after none, one or some of its writes leaves a prefix of
    /// its records when the log is opened again: dense seqs, a retry of a record that landed is
    /// a duplicate of it, one that did not is appended after them. The torn append itself was
    /// answered with an error, and the log refused appends until it was opened again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_commit_torn_by_a_crash_leaves_a_prefix_of_its_records() {
        for torn_after in [0, 1, 4] {
            let dir = tempfile::tempdir().expect("tempdir");
            let db = sled::open(dir.path()).expect("sled");
            let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
            log.append_batch(vec![record("anima.v1.config", "before", b"x")]).await.expect("append");
            log.tear_next_group_after(torn_after);
            // Records of a group's size each: five entries, so every tear leaves some unwritten.
            static LARGE: [u8; GROUP_BYTES_MAX] = [7u8; GROUP_BYTES_MAX];
            let torn: Vec<_> = (0..5).map(|n| record("anima.v1.config", &format!("torn-{n}"), &LARGE)).collect();
            assert!(log.append_batch(torn.clone()).await.is_err(), "the torn group is not acknowledged");
            let refused = log.append_batch(vec![record("anima.v1.config", "between", b"z")]).await;
            assert!(refused.is_err(), "appends are refused until the log is opened again");
            drop(log);

            let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
            let landed = torn_after as u64;
            assert_eq!(
                read_seqs(&log, 1, 100, None).await,
                (1..=1 + landed).collect::<Vec<_>>(),
                "torn after {torn_after}"
            );
            let retried = log.append_batch(torn.clone()).await.expect("append");
            let expected: Vec<AppendOutcome> = (0..5u64)
                .map(|n| match n < landed {
                    true => AppendOutcome::Duplicate { seq: 2 + n },
                    false => AppendOutcome::Appended { seq: 2 + n },
                })
                .collect();
            assert_eq!(retried, expected, "torn after {torn_after}");
            let next = log.append_batch(vec![record("anima.v1.config", "after", b"z")]).await.expect("append");
            assert_eq!(next, vec![AppendOutcome::Appended { seq: 7 }], "torn after {torn_after}");
        }
    }

    /// A group commit an older build left torn after its redo record is completed whole when
    /// the log opens, before the tail is read: every record of it reads back, and the redo
    /// record is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_group_commit_an_older_build_left_torn_is_completed_on_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = sled::open(dir.path()).expect("sled");
        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("open");
        log.append(record("anima.v1.config", "before", b"x")).await.expect("append");
        drop(log);
        let tree = db.open_tree(TREE_NAME).expect("tree");
        let redo_tree = db.open_tree(REDO_TREE_NAME).expect("tree");
        let mut batch = Writes::default();
        let mut entries = RecordEntries::new(RecordLayout::Grouped);
        static LARGE: [u8; GROUP_BYTES_MAX] = [7u8; GROUP_BYTES_MAX];
        let after_ns = SystemClock.now_ns() + SECOND_NS;
        for n in 0..3u64 {
            let torn = record("anima.v1.config", &format!("torn-{n}"), &LARGE);
            entries.push(&mut batch, 2 + n, after_ns + n as i64, &torn);
        }
        entries.close(&mut batch);
        assert!(!redo::write(&tree, &redo_tree, &group_redo_key(), &batch, Some(1)).expect("write"), "torn");
        tree.flush().expect("flush");

        let log = EmbeddedLog::open(db.clone(), EmbeddedConfig::default()).expect("reopen");
        assert_eq!(read_seqs(&log, 1, 100, None).await, [1, 2, 3, 4]);
        assert!(redo_tree.is_empty(), "the redo record is gone");
        let next = log.append(record("anima.v1.config", "after", b"z")).await.expect("append");
        assert_eq!(next, AppendOutcome::Appended { seq: 5 });
        drop(log);
    }
}
