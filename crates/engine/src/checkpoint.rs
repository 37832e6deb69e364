//! Checkpoints of the projection state in a store of their own: only changed keys, together with
//! the fold version and the stream identity (the applied seq is part of the state's meta entry).
//! A checkpoint from another fold version or another stream is discarded and the state rebuilt
//! from the log.
//!
//! The store is fjall (an LSM tree) in the data dir's [`CHECKPOINT_DIR`] folder, beside the sled
//! database of the embedded log. Checkpoints used to live in that sled database. Under
//! `anima-load` on JetStream (300 s, about 10,500 ops/s, README "The checkpoint store") sled's
//! file grew 15.6 MiB/s to 4.7 GiB: sled rewrites a page per changed entry and reclaims a segment
//! of its file only after rewriting what is still live in it (`store-stats` on a 180 s run's
//! data dir found about 5% of the file live), and only `anima-wake compact` gave the rest back,
//! offline. fjall appends a checkpoint to
//! its journal, flushes memtables into sorted tables and merges them in the background: the same
//! load against this store ended at 265 MiB (0.7 MiB/s). Its writes also no longer take sled's
//! process-wide lock, which every append of the embedded log takes too.
//!
//! A checkpoint is all or nothing: its entries, the fold version and the stream identity are one
//! write batch. fjall writes a batch to its journal followed by a checksum of it, and recovery
//! drops a last batch whose end is missing or does not match, so after a crash the store holds
//! the previous checkpoint or this one, never a mix.
//!
//! The entries of the tables keyed by (owner, slot) — a surface's rows and dedupe order, an
//! agent's settled-id order and queued items — are stored in pages of consecutive slots
//! (`anima_projections::slot_page`): a checkpoint reads each changed page, patches it and writes
//! it back once, and reads give the entries back one by one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anima_projections::slot_page;
use anima_projections::state::{State, FOLD_VERSION};

/// Prefix of state entries; the rest of the key is the state's own checkpoint key.
pub const STATE_PREFIX: u8 = b's';
/// Prefix of the maintained analytics counters (one entry per time bucket).
pub const ANALYTICS_PREFIX: u8 = b'a';
/// The fold version the checkpoint was taken by (big-endian u32).
pub const FOLD_VERSION_KEY: &[u8] = b"m:fold_version";
/// The identity of the stream the checkpoint was taken on.
pub const STREAM_KEY: &[u8] = b"m:stream";
/// The epoch of the runner that owns the checkpoint (big-endian u64), taken at each restore.
/// A write checks it under the same guard that commits its batch, so a runner that was replaced
/// (aborted while its write still waited on the checkpoint thread, a crash simulated in-process) can
/// never land a write after its successor's: a checkpoint is never a mix of two runners.
pub const EPOCH_KEY: &[u8] = b"m:epoch";
/// The store key of the fold's meta entry (state key `[0]`), which holds the applied seq.
const META_KEY: [u8; 2] = [STATE_PREFIX, 0];

/// The folder of a data dir that holds the checkpoint store.
pub const CHECKPOINT_DIR: &str = "checkpoints";
/// The checkpoints of a data dir are named this, then the backend (one keyspace each).
pub const CHECKPOINT_TREE_PREFIX: &str = "checkpoint-";
/// Name of the checkpoint of the embedded log in a data dir.
pub const EMBEDDED_CHECKPOINT_TREE: &str = "checkpoint-embedded";
/// Memory of the checkpoint store's write buffer (one memtable, then sealed ones while they are
/// written out; each sealed memtable becomes a sorted table on disk within seconds, synced when
/// written). Under `anima-load` on JetStream, with fjall's defaults (64 MiB memtables, two
/// background threads at normal priority) requests stalled 100–200 ms about every 25 s, as each
/// memtable was written out: 4,711 calls took 100 ms or more in 300 s. With 16 MiB memtables and
/// one background thread at the checkpoint thread's priority, 569 did (none with sled). On the
/// embedded log a table's sync and the log's group-commit syncs share the disk: in a sampled run
/// both group commits over 25 ms ended as fjall's worker wrote out about 10 MB. With 8 MiB
/// memtables and 4 MiB tables (below), 10-minute embedded runs had 10 group commits over 25 ms
/// against 103 with 16 and 8 MiB, and 17 Sends of 100 ms or more against 110 (one run each,
/// throughput level). README, "The checkpoint store" and stop 47.
const MEMTABLE_BYTES: u64 = 8 * 1024 * 1024;
/// The size of the sorted tables that merges write (fjall's default is 64 MiB). A table is
/// synced to disk when it is written, on the disk the embedded log's group commits sync to.
/// Under `anima-load` (embedded, 300 s, one run each) the calls that took 100 ms or more fell
/// from 2,715 with 64 MiB tables to 201 with 8 MiB, and a variant that merged four times less
/// often but as much each time (16 tables waiting instead of 4) had 3,868 (README, "The
/// checkpoint store"); 4 MiB with the 8 MiB memtables above (stop 47). A merge finishes its
/// last table (index, filter, the file's sync) while it holds the lock every read of the tree
/// takes (lsm-tree 3.1.10), so the fold's reads back wait up to a table's sync: with 1 MiB
/// tables a 300 s embedded run had 11 holds of the state lock of 20 ms or more against 83 with
/// 4 MiB, but the store's one worker fell behind and the engine's RSS grew past its budget
/// (1.58 GiB at the end, +67% over the last half; stop 59).
const TABLE_BYTES: u64 = 4 * 1024 * 1024;
/// How long [`CheckpointStore::write_out_memtable`] waits at most for fjall to write out what
/// was sealed and delete the journal it replaced: milliseconds on an idle machine, longer when
/// fjall's worker is in a merge on a busy disk. A bound, so that a stop cannot hang on it.
const JOURNAL_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// The journal size past which fjall 3.1.13 starts a new journal file when it writes a memtable
/// out (a constant in its worker).
const FJALL_JOURNAL_ROTATION_BYTES: u64 = 64_000_000;
/// The shortest journal a stop pads up to [`FJALL_JOURNAL_ROTATION_BYTES`] so that fjall replaces
/// it (see [`CheckpointStore::write_out_memtable`]). About where the two costs meet: the next
/// open reads 8 MiB of journal in 130–180 ms (16–22 ms a MiB here, README "The scale figure"),
/// and a stop padded a journal of 18.6 MiB with 44 MiB in 134–139 ms in the test below (idle
/// machine; under `anima-load`'s stop, 8 MiB took 139–232 ms and 16 MiB 607 ms).
const JOURNAL_PADDED_FROM: u64 = 8 * 1024 * 1024;
/// The keyspace the padding is written to (see [`pad_journal`]); not a checkpoint, so
/// [`CheckpointDb::names`] leaves it out.
const JOURNAL_PADDING_KEYSPACE: &str = "journal-padding";
/// The padding keyspace's memtable size: past the rotation size, so that fjall never writes a
/// memtable of padding out before its last removal (it would then keep the last value in a
/// table until a merge). Its memory is one chunk: every entry shares it.
const JOURNAL_PADDING_MEMTABLE_BYTES: u64 = 2 * FJALL_JOURNAL_ROTATION_BYTES;
/// The one key the padding is written under, and removed at once.
const JOURNAL_PADDING_KEY: &[u8] = b"padding";
/// One chunk of padding: one journal entry.
const JOURNAL_PADDING_CHUNK: usize = 4 * 1024 * 1024;
const MIB_F64: f64 = 1024.0 * 1024.0;
/// The checkpoint store's cache of its tables' blocks when nothing else is configured.
pub const CHECKPOINT_CACHE_BYTES_DEFAULT: u64 = 64 * 1024 * 1024;

/// Name of the checkpoint of a JetStream stream in a data dir.
pub fn jetstream_checkpoint_tree(stream: &str) -> String {
    format!("{CHECKPOINT_TREE_PREFIX}jetstream-{stream}")
}

/// A checkpoint's change set: full tree keys, each with its new value or `None` (removed).
type ChangeSet = Vec<(Vec<u8>, Option<Vec<u8>>)>;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The checkpoint store failed; the checkpoint was not written (or not read).
    #[error("checkpoint store: {0}")]
    Store(#[from] fjall::Error),
    /// The data dir's files could not be read (sizing it).
    #[error("data dir: {0}")]
    Io(#[from] std::io::Error),
    /// A checkpoint's name the store cannot hold (empty, or longer than 255 bytes).
    #[error("checkpoint name {0:?} is empty or longer than 255 bytes")]
    Name(String),
    #[error("checkpoint task failed: {0}")]
    Task(String),
    /// A write refused by [`CheckpointStore::inject_write_failure`] (fault injection).
    #[error("injected checkpoint write failure")]
    Injected,
    /// Another runner restored this checkpoint since this one did: this runner is stale and
    /// must stop (its write was not applied).
    #[error("the checkpoint was taken over by another runner (epoch {stored}, this runner {own})")]
    Superseded { own: u64, stored: u64 },
    /// A stored entry does not decode: the checkpoint is unusable (the runner rebuilds).
    #[error(transparent)]
    Decode(#[from] anima_projections::state::CheckpointDecodeError),
    /// A stored slot page does not decode.
    #[error(transparent)]
    Page(#[from] slot_page::PageError),
}

/// The checkpoint store of one data dir ([`CHECKPOINT_DIR`]), which may hold the checkpoints of
/// several logs (one keyspace each). One handle per data dir and process: the store locks its
/// folder while a handle (or a [`CheckpointStore`] of it) is alive.
#[derive(Clone)]
pub struct CheckpointDb {
    db: fjall::Database,
    data_dir: std::path::PathBuf,
    /// Whether the open read a journal of [`JOURNAL_PADDED_FROM`] or more (see
    /// [`CheckpointStore::take_long_journal_read_at_open`]); cleared by the first store that
    /// takes it.
    long_journal_at_open: Arc<std::sync::atomic::AtomicBool>,
    /// How long the open took, and the bytes of journal it read (see [`CheckpointDb::opened`]).
    opened: (std::time::Duration, u64),
}

impl CheckpointDb {
    /// Opens (creating it) the checkpoint store of the data dir `data_dir`, whose block cache
    /// takes `cache_bytes`.
    pub fn open(data_dir: &std::path::Path, cache_bytes: u64) -> Result<Self, CheckpointError> {
        let started = Instant::now();
        let db = fjall::Database::builder(data_dir.join(CHECKPOINT_DIR))
            .cache_size(cache_bytes)
            // One thread writes memtables out and merges tables, so that the store's background
            // work never takes both of a small machine's cores from the requests.
            .worker_threads(1)
            .open()?;
        nice_store_threads();
        // After the open, which cut the journal file to what it holds (see `journal_bytes`).
        let journal_bytes = journal_bytes(data_dir);
        let took = started.elapsed();
        tracing::info!(
            journal_mib = %format_args!("{:.1}", journal_bytes as f64 / MIB_F64),
            open_ms = %format_args!("{:.0}", took.as_secs_f64() * 1e3),
            "checkpoint store opened (it reads its whole journal to open)"
        );
        Ok(CheckpointDb {
            db,
            data_dir: data_dir.to_owned(),
            long_journal_at_open: Arc::new((journal_bytes >= JOURNAL_PADDED_FROM).into()),
            opened: (took, journal_bytes),
        })
    }

    /// How long the store took to open, and the bytes of journal it read and replayed to open
    /// (most of the open: about 16–22 ms a MiB here, README "The scale figure"), for the
    /// `anima_checkpoint_store_open_seconds` and `anima_checkpoint_journal_read_at_open_bytes`
    /// gauges.
    pub fn opened(&self) -> (std::time::Duration, u64) {
        self.opened
    }

    /// Whether the data dir holds a checkpoint store (the tools read one only if so).
    pub fn exists(data_dir: &std::path::Path) -> bool {
        data_dir.join(CHECKPOINT_DIR).is_dir()
    }

    /// The names of the checkpoints the store holds.
    pub fn names(&self) -> Vec<String> {
        self.db
            .list_keyspace_names()
            .iter()
            .filter(|name| &***name != JOURNAL_PADDING_KEYSPACE)
            .map(|name| (**name).to_owned())
            .collect()
    }

    /// The checkpoint `name` as it is stored (for tools: the census, the copy of `compact`, the
    /// comparison of `replay verify`, tests), or `None` when the store has none of that name.
    pub fn existing(&self, name: &str) -> Result<Option<fjall::Keyspace>, CheckpointError> {
        if !self.db.keyspace_exists(name) {
            return Ok(None);
        }
        self.keyspace(name).map(Some)
    }

    /// The checkpoint `name` as it is stored, created empty when the store has none of that
    /// name (the copy of `compact`, tests).
    pub fn keyspace(&self, name: &str) -> Result<fjall::Keyspace, CheckpointError> {
        if name.is_empty() || name.len() > usize::from(u8::MAX) {
            return Err(CheckpointError::Name(name.chars().take(64).collect()));
        }
        Ok(self.db.keyspace(name, || {
            fjall::KeyspaceCreateOptions::default().max_memtable_size(MEMTABLE_BYTES).compaction_strategy(Arc::new(
                fjall::compaction::Leveled::default().with_table_target_size(TABLE_BYTES),
            ))
        })?)
    }

    /// Deletes the checkpoint `name` and its files (nothing when there is none).
    pub fn delete(&self, name: &str) -> Result<(), CheckpointError> {
        if let Some(keyspace) = self.existing(name)? {
            self.db.delete_keyspace(keyspace)?;
        }
        Ok(())
    }

    /// Writes everything written so far to disk (fsync).
    pub fn persist(&self) -> Result<(), CheckpointError> {
        Ok(self.db.persist(fjall::PersistMode::SyncAll)?)
    }
}

/// The bytes of the checkpoint store's journal files in `data_dir` (0 when it has none). The store
/// reads and replays every entry of them when it opens, so this is what a start's time grows
/// with: opening took 0.56–0.67 s with a journal of 59.6 MB holding 480k entries, about 1.2 µs
/// an entry (README, "The scale figure"). Measured right after an open, it is what the open read
/// (see [`journals`] for how a file's written bytes are told).
fn journal_bytes(data_dir: &std::path::Path) -> u64 {
    journals(data_dir).iter().map(|(_, written)| written).sum()
}

/// The journal files of the store in `data_dir`: each one's id and the bytes written to it.
/// fjall makes a new journal file 64 MiB long at once without writing it (a sparse file on the
/// file systems Linux servers use), and every write batch reaches the file before the write
/// returns, so the smaller of a file's length and its allocated blocks is what was written, to
/// the block. On a file system without sparse files this reads a new journal as full: it is
/// counted as 64 MiB, and a stop then pads nothing.
fn journals(data_dir: &std::path::Path) -> Vec<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    let Ok(files) = std::fs::read_dir(data_dir.join(CHECKPOINT_DIR)) else { return Vec::new() };
    files
        .flatten()
        .filter_map(|file| {
            let path = file.path();
            path.extension().filter(|extension| *extension == "jnl")?;
            let id = path.file_stem()?.to_str()?.parse::<u64>().ok()?;
            let metadata = file.metadata().ok()?;
            Some((id, metadata.len().min(metadata.blocks() * 512)))
        })
        .collect()
}

/// Writes the memtable of every keyspace of the store out (this store's checkpoint, another
/// checkpoint of the same data dir, the padding), then waits (at most [`JOURNAL_RELEASE_WAIT`])
/// until fjall has written out every memtable sealed before, and deleted every journal but the
/// one it writes to. fjall deletes a journal only once every keyspace's entries in it are in
/// tables, and it does so just after the write-out: the process should not stop in between.
///
/// A memtable that filled up before this call (a large checkpoint, or the journal replayed at an
/// open) was sealed then and is written out by fjall's worker in its own time, possibly after a
/// merge it is busy with. `rotate_memtable_and_wait` returns at once for a keyspace whose active
/// memtable is empty, and the journal is only replaced when that worker gets to the sealed
/// memtable, so the wait is on the sealed memtables and queued write-outs as well as on the
/// journal count. With the count alone, a write-out could return while the old journal was
/// still the current one: seen in the journal tests below (3 failures in 30 runs with the disk
/// and a core kept busy), with fjall's checkpoint memtable sealed and its active one empty.
fn write_out_and_wait(db: &CheckpointDb) -> Result<(), CheckpointError> {
    use fjall::AbstractTree as _;
    let mut keyspaces = Vec::new();
    for name in db.db.list_keyspace_names() {
        // `rotate_memtable_and_wait` is hidden from fjall's docs ("used in tests"): pinned by the
        // lock file; the tests below fail if it stops starting a new journal.
        if let Some(keyspace) = db.existing(&name)? {
            keyspace.rotate_memtable_and_wait()?;
            keyspaces.push(keyspace);
        }
    }
    let waited = Instant::now();
    while (db.db.outstanding_flushes() > 0
        || keyspaces.iter().any(|keyspace| keyspace.tree.sealed_memtable_count() > 0)
        || db.db.journal_count() > 1)
        && waited.elapsed() < JOURNAL_RELEASE_WAIT
    {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(())
}

/// The journal file fjall writes to now (the newest of [`journals`]): its id and the bytes
/// written to it, `None` when there is none.
fn active_journal(data_dir: &std::path::Path) -> Option<(u64, u64)> {
    journals(data_dir).into_iter().max_by_key(|(id, _)| *id)
}

/// Fills the journal `id`, of which `written` bytes are written, past
/// [`FJALL_JOURNAL_ROTATION_BYTES`] with padding and writes the memtables out, so that fjall
/// starts a new journal. The padding is chunks of [`JOURNAL_PADDING_CHUNK`] bytes that do not
/// compress (fjall compresses large values in its journal), each written under
/// [`JOURNAL_PADDING_KEY`] in a keyspace of its own and removed at once, so the store keeps none
/// of it: the write-out of a memtable drops the values a removal shadows. A margin covers the
/// journal's own framing; should fjall still not start a new journal, one more chunk is written,
/// twice at most. Returns the bytes of padding written.
fn pad_journal(db: &CheckpointDb, id: u64, written: u64) -> Result<u64, CheckpointError> {
    const MARGIN: u64 = 64 * 1024;
    let padding = db.db.keyspace(JOURNAL_PADDING_KEYSPACE, || {
        fjall::KeyspaceCreateOptions::default().max_memtable_size(JOURNAL_PADDING_MEMTABLE_BYTES)
    })?;
    let chunk = fjall::Slice::from(incompressible(0, JOURNAL_PADDING_CHUNK));
    let mut chunks = (FJALL_JOURNAL_ROTATION_BYTES + MARGIN).saturating_sub(written).div_ceil(chunk.len() as u64);
    let mut padded = 0;
    for _ in 0..3 {
        for _ in 0..chunks {
            padding.insert(JOURNAL_PADDING_KEY, chunk.clone())?;
            padding.remove(JOURNAL_PADDING_KEY)?;
            padded += chunk.len() as u64;
        }
        // The padding's write-out starts the new journal.
        write_out_and_wait(db)?;
        if active_journal(&db.data_dir).is_none_or(|(now, _)| now != id) {
            break;
        }
        chunks = 1;
    }
    Ok(padded)
}

/// `len` bytes from a xorshift generator seeded with `seed`: nothing an LZ-type compressor can
/// shorten.
fn incompressible(seed: u64, len: usize) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ seed;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        bytes.extend_from_slice(&x.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// One projection checkpoint in a data dir's checkpoint store.
#[derive(Clone)]
pub struct CheckpointStore {
    db: CheckpointDb,
    tree: fjall::Keyspace,
    /// Set by fault injection: every later write fails without touching the store.
    fail_writes: Arc<std::sync::atomic::AtomicBool>,
    /// This store's epoch, taken by its last restore (0: never restored, writes take none).
    epoch: Arc<AtomicU64>,
    /// The store's own thread for checkpoint work (see [`CheckpointStore::background`]).
    background: std::sync::mpsc::Sender<BackgroundJob>,
}

type BackgroundJob = Box<dyn FnOnce() + Send>;

/// The nice value of a store's checkpoint thread. Measured under `anima-load`, the checkpoint
/// writes kept one of the two cores busy 60% of the time, and 97% of the log's group commits
/// slower than 4 ms overlapped one: on a full machine they took CPU from the threads a request
/// waits on (the log writer, the fold, the gRPC workers). Niced, the checkpoint yields to them
/// when the cores are contended and still gets every idle cycle; a checkpoint that falls behind
/// only means the next one carries more entries.
const CHECKPOINT_THREAD_NICE: i32 = 5;

/// Starts a store's checkpoint thread: it runs the jobs it is sent, one at a time, at
/// [`CHECKPOINT_THREAD_NICE`], and ends when every handle of the store is dropped.
fn start_background() -> Result<std::sync::mpsc::Sender<BackgroundJob>, CheckpointError> {
    let (jobs, next) = std::sync::mpsc::channel::<BackgroundJob>();
    std::thread::Builder::new()
        .name("anima-checkpoint".into())
        .spawn(move || {
            // On Linux a thread id names one thread, so this lowers this thread only.
            if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), CHECKPOINT_THREAD_NICE)
            {
                tracing::debug!(error = %e, "the checkpoint thread keeps the default priority");
            }
            while let Ok(job) = next.recv() {
                job();
            }
        })
        .map_err(|e| CheckpointError::Task(format!("cannot start the checkpoint thread: {e}")))?;
    Ok(jobs)
}

impl CheckpointStore {
    /// Opens (or creates) the checkpoint `name` in `db`.
    pub fn open(db: &CheckpointDb, name: &str) -> Result<Self, CheckpointError> {
        let tree = db.keyspace(name)?;
        Ok(CheckpointStore {
            db: db.clone(),
            tree,
            fail_writes: Default::default(),
            epoch: Default::default(),
            background: start_background()?,
        })
    }

    /// Runs `work` on the store's checkpoint thread, which yields to the threads requests wait
    /// on (see [`CHECKPOINT_THREAD_NICE`]): encoding and writing a checkpoint.
    pub async fn background<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, CheckpointError> {
        let (done, result) = tokio::sync::oneshot::channel();
        let job: BackgroundJob = Box::new(move || {
            let _ = done.send(work());
        });
        self.background.send(job).map_err(|_| CheckpointError::Task("the checkpoint thread has stopped".into()))?;
        result.await.map_err(|_| CheckpointError::Task("the checkpoint thread dropped a job".into()))
    }

    /// Fault injection for tests and simulations: from now on every write fails, as a full or
    /// broken disk would make it. What the runner does then (stop, say why, let the instance go
    /// unhealthy) is what supervision is tested with.
    pub fn inject_write_failure(&self) {
        self.fail_writes.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The checkpointed state if it was taken by this fold version on this stream; otherwise
    /// clears the tree and returns an empty state.
    pub async fn restore(&self, stream_identity: &str) -> Result<State, CheckpointError> {
        let tree = self.tree.clone();
        let db = self.db.clone();
        let stream_identity = stream_identity.to_owned();
        let (epoch, state) = tokio::task::spawn_blocking(move || -> Result<(u64, State), CheckpointError> {
            // The epoch first: any write of an earlier runner that has not landed yet is refused
            // from here on, so what is read below is one runner's checkpoint, whole.
            let epoch = take_epoch(&tree, &db)?;
            let version_ok = tree.get(FOLD_VERSION_KEY)?.as_deref() == Some(&FOLD_VERSION.to_be_bytes()[..]);
            let stream_ok = tree.get(STREAM_KEY)?.as_deref() == Some(stream_identity.as_bytes());
            if version_ok && stream_ok {
                let mut state = State::new();
                let mut intact = true;
                let mut loaded = std::collections::BTreeMap::<u8, (usize, usize)>::new();
                for tag in (0..=u8::MAX).filter(|tag| !State::is_cold_tag(*tag)) {
                    let mut entries = Vec::new();
                    for entry in tree.prefix([STATE_PREFIX, tag]) {
                        let (key, value) = entry.into_inner()?;
                        entries.push((StateKey(key), value));
                    }
                    if !entries.is_empty() {
                        loaded
                            .insert(tag, (entries.len(), entries.iter().map(|(_, value)| value.len()).sum::<usize>()));
                    }
                    if let Err(e) = state.load_table_entries(tag, &entries) {
                        tracing::warn!(error = %e, "checkpoint entry does not decode; rebuilding from the log");
                        intact = false;
                        break;
                    }
                }
                tracing::debug!(?loaded, "checkpoint entries loaded by table tag (entries, value bytes)");
                if intact {
                    return Ok((epoch, state));
                }
            } else if !tree.is_empty()? {
                tracing::info!(version_ok, stream_ok, "checkpoint is from another fold version or stream; rebuilding");
            }
            tree.clear()?;
            tree.insert(EPOCH_KEY, &epoch.to_be_bytes()[..])?;
            db.persist()?;
            Ok((epoch, State::new()))
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))??;
        self.epoch.store(epoch, std::sync::atomic::Ordering::SeqCst);
        Ok(state)
    }

    /// The maintained analytics counters of the checkpoint (call after [`CheckpointStore::restore`],
    /// which clears a checkpoint it cannot use, counters included).
    pub async fn restore_analytics(&self) -> Result<crate::analytics::MaintainedAnalytics, CheckpointError> {
        let tree = self.tree.clone();
        tokio::task::spawn_blocking(move || {
            let mut analytics = crate::analytics::MaintainedAnalytics::default();
            for entry in tree.prefix([ANALYTICS_PREFIX]) {
                let (key, value) = entry.into_inner()?;
                if let Err(reason) = analytics.load_entry(&key[1..], &value) {
                    return Err(CheckpointError::Decode(anima_projections::state::CheckpointDecodeError {
                        table: "analytics",
                        reason,
                    }));
                }
            }
            Ok(analytics)
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
    }

    /// Writes changed entries (state and analytics counters), the fold version and the stream
    /// identity as one write batch, all or nothing (synced to disk when `durable`).
    pub async fn write(
        &self,
        stream_identity: &str,
        changes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        analytics_changes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        durable: bool,
    ) -> Result<(), CheckpointError> {
        if self.fail_writes.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(CheckpointError::Injected);
        }
        let db = self.db.clone();
        let tree = self.tree.clone();
        let stream_identity = stream_identity.to_owned();
        let own = self.epoch.load(std::sync::atomic::Ordering::SeqCst);
        self.background(move || {
            let prefixed = changes
                .into_iter()
                .map(|change| (STATE_PREFIX, change))
                .chain(analytics_changes.into_iter().map(|change| (ANALYTICS_PREFIX, change)));
            let mut changes: ChangeSet = prefixed
                .map(|(prefix, (key, value))| {
                    let mut full = Vec::with_capacity(key.len() + 1);
                    full.push(prefix);
                    full.extend(key);
                    (full, value)
                })
                .collect();
            changes.push((FOLD_VERSION_KEY.to_vec(), Some(FOLD_VERSION.to_be_bytes().to_vec())));
            changes.push((STREAM_KEY.to_vec(), Some(stream_identity.into_bytes())));
            // Applied only while this runner still owns the checkpoint (see EPOCH_KEY): the
            // epoch is read and the batch committed under the process's epoch guard, which a
            // restore takes too, so no restore can come between the check and the write. (Two
            // processes never share a data dir: the stores lock it.)
            {
                let _guard = EPOCH_GUARD.lock().unwrap_or_else(|p| p.into_inner());
                let stored = tree.get(EPOCH_KEY)?.as_deref().map_or(0, decode_epoch);
                if own != 0 && stored != own {
                    return Err(CheckpointError::Superseded { own, stored });
                }
                commit_changes(&db.db, &tree, &changes)?;
            }
            // Not synced otherwise: a checkpoint lost to a crash only means the restart refolds
            // a little more of the log (the journal keeps whole batches, so what is restored is
            // one whole checkpoint). The last checkpoint of a stopping runner is synced.
            if durable {
                db.persist()?;
            }
            Ok(())
        })
        .await?
    }

    /// Whether the store's open read a journal of [`JOURNAL_PADDED_FROM`] or more, which only a
    /// crash leaves (a stop replaces it, see [`CheckpointStore::write_out_memtable`]); true for
    /// the first caller only. The runner then writes the memtable out before its first
    /// checkpoint, as a stop would have: another crash soon after does not make the next start
    /// read that journal again, and the entries the open replayed into the memtable go to
    /// tables.
    pub fn take_long_journal_read_at_open(&self) -> bool {
        self.db.long_journal_at_open.swap(false, Ordering::SeqCst)
    }

    /// Writes the memtables of the store out to tables and starts a new journal, so that the
    /// next open reads (almost) none of the journal: what a stopping runner does after its last
    /// checkpoint, a start that read a long journal before its first (see
    /// [`CheckpointStore::take_long_journal_read_at_open`]), and a runner in a quiet spell
    /// (`RunnerConfig::idle_write_out_after`), so that a crash then leaves a short journal.
    /// Every open reads and replays the whole journal, about 1.2–1.9 µs an entry: 1.0 s of a
    /// 1.1–1.2 s restart with a journal of 55–62 MiB at stop 53, 1.75 s of 1.99 s with 55.6 MiB
    /// at stop 54 (README, "The scale figure").
    ///
    /// fjall 3.1.13 starts a new journal file only when it writes a memtable out while the
    /// current journal has passed [`FJALL_JOURNAL_ROTATION_BYTES`] (a constant in its worker, not
    /// a setting), and deletes the old file once everything in it is in tables. So:
    /// - a journal past that size is replaced by the write-out alone (an engine that wrote large
    ///   checkpoints and then little, after a rebuild or a long catch-up, kept such a journal,
    ///   which nothing wrote out while it ran);
    /// - a journal of [`JOURNAL_PADDED_FROM`] or more but under the size is first filled up to
    ///   it with padding (see [`pad_journal`]), then written out, and is replaced too;
    /// - a shorter one stays as it is, and nothing is written out (unless older journals wait
    ///   for it): see [`JOURNAL_PADDED_FROM`] for the floor, and a write-out would start a merge
    ///   that fjall's close waits for.
    ///
    /// `at` names the moment in the log line of a padding: `stop`, `start` or `idle`.
    pub async fn write_out_memtable(&self, at: &'static str) -> Result<(), CheckpointError> {
        let db = self.db.clone();
        self.background(move || {
            let Some((id, written)) = active_journal(&db.data_dir) else { return Ok(()) };
            if !(JOURNAL_PADDED_FROM..FJALL_JOURNAL_ROTATION_BYTES).contains(&written) {
                // Past the size, the write-out replaces the journal. Under the padding's floor,
                // only to let fjall delete older journals: a write-out that replaces nothing
                // would only start a merge of tables, which fjall's close waits for (1.7–1.9 s
                // of a stop measured under `anima-scale`).
                if written >= FJALL_JOURNAL_ROTATION_BYTES || db.db.journal_count() > 1 {
                    write_out_and_wait(&db)?;
                }
                return Ok(());
            }
            let started = Instant::now();
            let padded = pad_journal(&db, id, written)?;
            let (replaced, left) = match active_journal(&db.data_dir) {
                Some((now, left)) => (now != id, left),
                None => (true, 0),
            };
            tracing::info!(
                journal_mib = %format_args!("{:.1}", written as f64 / MIB_F64),
                padding_mib = %format_args!("{:.1}", padded as f64 / MIB_F64),
                left_mib = %format_args!("{:.1}", left as f64 / MIB_F64),
                took_ms = %format_args!("{:.0}", started.elapsed().as_secs_f64() * 1e3),
                replaced,
                at = %at,
                "checkpoint store's journal padded to fjall's rotation size"
            );
            Ok(())
        })
        .await?
    }

    /// How the store of this checkpoint opened (see [`CheckpointDb::opened`]).
    pub fn opened(&self) -> (std::time::Duration, u64) {
        self.db.opened()
    }

    /// The size of the data dir's files on disk (the checkpoint store, and the embedded log's
    /// sled files), for the `anima_data_dir_bytes` gauge.
    pub fn data_dir_bytes(&self) -> Result<u64, CheckpointError> {
        Ok(crate::data_dir::bytes_on_disk(&self.db.data_dir)?)
    }

    /// The stored checkpoint itself, for tests that damage it as a crash or a bug would.
    pub fn stored(&self) -> &fjall::Keyspace {
        &self.tree
    }

    /// The whole checkpointed state, every entry in memory (those a restore leaves in the store
    /// too), as one snapshot of the store shows it while the runner goes on writing: the state of
    /// the fold at the checkpoint's applied seq (its meta says which; `replay verify` compares
    /// the two). `None` when there is no checkpoint, its applied seq is not in `seqs`, or it was
    /// taken by another fold version or on another stream than `stream_identity`; those are
    /// looked at in the snapshot before anything else is read. Reads O(state) entries, never
    /// the log: a rebuild that would otherwise fold the log from its start (`Replay.StateAt`'s
    /// first call) starts here. Blocking; call it off the async workers.
    pub fn load_whole(
        &self,
        stream_identity: &str,
        seqs: std::ops::RangeInclusive<u64>,
    ) -> Result<Option<State>, CheckpointError> {
        use fjall::Readable as _;
        let snapshot = self.db.db.snapshot();
        let Some(mut state) = self.usable_meta(&snapshot, stream_identity)? else { return Ok(None) };
        if !seqs.contains(&state.meta.applied_seq) {
            return Ok(None);
        }
        for (key, value) in scan_state_entries(|key| snapshot.prefix(&self.tree, key), &[])? {
            state.load_entry(&key, &value)?;
        }
        Ok(Some(state))
    }

    /// The applied seq of the stored checkpoint when [`CheckpointStore::load_whole`] would use
    /// it: there is one, of this fold version, of the stream `stream_identity` (for tools that
    /// say where a state will start before loading it).
    pub fn usable_seq(&self, stream_identity: &str) -> Result<Option<u64>, CheckpointError> {
        let state = self.usable_meta(&self.db.db.snapshot(), stream_identity)?;
        Ok(state.map(|state| state.meta.applied_seq))
    }

    /// A state holding only the checkpoint's meta (its applied seq), as `snapshot` shows it, when
    /// the checkpoint exists and was taken by this fold version on `stream_identity`.
    fn usable_meta(&self, snapshot: &fjall::Snapshot, stream_identity: &str) -> Result<Option<State>, CheckpointError> {
        use fjall::Readable as _;
        let mut state = State::new();
        match snapshot.get(&self.tree, META_KEY)? {
            Some(meta) => state.load_entry(&META_KEY[1..], &meta)?,
            None => return Ok(None),
        }
        let version_ok =
            snapshot.get(&self.tree, FOLD_VERSION_KEY)?.as_deref() == Some(&FOLD_VERSION.to_be_bytes()[..]);
        let stream_ok = snapshot.get(&self.tree, STREAM_KEY)?.as_deref() == Some(stream_identity.as_bytes());
        Ok((version_ok && stream_ok).then_some(state))
    }

    /// The applied seq of the stored checkpoint (0 when none), for tools and tests.
    pub fn checkpointed_seq(&self) -> Result<u64, CheckpointError> {
        match self.tree.get(META_KEY)? {
            Some(value) => {
                let mut state = State::new();
                state.load_entry(&META_KEY[1..], &value)?;
                Ok(state.meta.applied_seq)
            }
            None => Ok(0),
        }
    }
}

/// The checkpoint's state entries as the fold's cold store: entries let go of to keep memory under
/// the budget are read back from here (see `anima_projections::cold`). Reads are synchronous
/// (the store's memtables and block cache, else its files) and come only from the fold.
pub struct StoredCold {
    tree: fjall::Keyspace,
    reads: Arc<ColdReads>,
}

/// A read back from the checkpoint store at least this long is logged (debug) with its table's
/// tag: the fold waits for it under the state lock, and so does every request behind it. Such
/// reads wait for fjall's version lock, which every read takes and which fjall holds while it
/// writes and syncs a new version of the tree (each memtable written out, each merge): 61–74
/// such reads of 10 ms or more in 180 s of `anima-load`, the slowest 41–74 ms (README, stop 50).
const SLOW_COLD_READ: std::time::Duration = std::time::Duration::from_millis(10);

/// What the fold read back from the checkpoint store, counted since the engine started: the
/// reads (a point read or a scan each), the entries they gave back, and the time they took.
/// Each read runs on the fold's thread under the state lock, so this time is time every waiting
/// request waited too.
#[derive(Debug, Default)]
pub struct ColdReads {
    reads: AtomicU64,
    entries: AtomicU64,
    nanos: AtomicU64,
}

impl ColdReads {
    /// (reads, entries, seconds) so far.
    pub fn totals(&self) -> (u64, u64, f64) {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        (load(&self.reads), load(&self.entries), load(&self.nanos) as f64 / 1e9)
    }

    fn count<T>(&self, started: Instant, key: &[u8], entries: usize, result: T) -> T {
        let took = started.elapsed();
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.entries.fetch_add(entries as u64, Ordering::Relaxed);
        self.nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if took >= SLOW_COLD_READ {
            tracing::debug!(
                table_tag = key.first().copied().unwrap_or_default(),
                entries,
                ms = %format_args!("{:.1}", took.as_secs_f64() * 1e3),
                "slow read back from the checkpoint store"
            );
        }
        result
    }
}

impl StoredCold {
    /// The fold's reads of `store`, counted into `reads`.
    pub fn new(store: &CheckpointStore, reads: Arc<ColdReads>) -> Self {
        StoredCold { tree: store.tree.clone(), reads }
    }
}

impl anima_projections::cold::ColdStore for StoredCold {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let started = Instant::now();
        let value = state_get(&self.tree, key).map_err(|e| e.to_string());
        let found = matches!(value, Ok(Some(_)));
        self.reads.count(started, key, usize::from(found), value)
    }

    fn get_page(&self, key: &[u8]) -> Result<anima_projections::cold::Entries, String> {
        let started = Instant::now();
        let entries = state_get_page(&self.tree, key).map_err(|e| e.to_string());
        let found = entries.as_ref().map_or(0, Vec::len);
        self.reads.count(started, key, found, entries)
    }

    fn scan(&self, prefix: &[u8]) -> Result<anima_projections::cold::Entries, String> {
        let started = Instant::now();
        let entries = state_scan(&self.tree, prefix).map_err(|e| e.to_string());
        let found = entries.as_ref().map_or(0, Vec::len);
        self.reads.count(started, prefix, found, entries)
    }

    fn scan_after(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<anima_projections::cold::Entries, String> {
        let started = Instant::now();
        if !slot_page::page_scan_prefixes(prefix).is_empty() {
            // A paged table's entries are inside its pages: scanned whole, then cut.
            let entries = state_scan(&self.tree, prefix).map_err(|e| e.to_string())?;
            let page = anima_projections::cold::page_of(entries, after, limit);
            return Ok(self.reads.count(started, prefix, page.len(), page));
        }
        let start = match after {
            Some(after) => std::ops::Bound::Excluded(state_key(after)),
            None => std::ops::Bound::Included(state_key(prefix)),
        };
        let full_prefix = state_key(prefix);
        let mut out = Vec::new();
        for entry in self.tree.range::<Vec<u8>, _>((start, std::ops::Bound::Unbounded)) {
            let (key, value) = entry.into_inner().map_err(|e| e.to_string())?;
            if !key.starts_with(&full_prefix) || out.len() >= limit {
                break;
            }
            out.push((key[1..].to_vec(), value.to_vec()));
        }
        Ok(self.reads.count(started, prefix, out.len(), out))
    }
}

/// A stored state entry's key seen as the state's own key (without [`STATE_PREFIX`]), so a
/// restore hands the store's bytes to the state without copying them.
struct StateKey(fjall::Slice);

impl AsRef<[u8]> for StateKey {
    fn as_ref(&self) -> &[u8] {
        self.0.get(1..).unwrap_or_default()
    }
}

fn state_key(key: &[u8]) -> Vec<u8> {
    let mut full = Vec::with_capacity(key.len() + 1);
    full.push(STATE_PREFIX);
    full.extend_from_slice(key);
    full
}

/// The stored value of the state entry `key` (the state's own key), from its slot page if its
/// table is paged ([`slot_page`]).
fn state_get(tree: &fjall::Keyspace, key: &[u8]) -> Result<Option<Vec<u8>>, CheckpointError> {
    match slot_page::paged_key(key) {
        Some(paged) => match tree.get(state_key(&paged.page_key))? {
            Some(page) => Ok(slot_page::page_get(&page, paged.index)?),
            None => Ok(None),
        },
        None => Ok(tree.get(state_key(key))?.map(|v| v.to_vec())),
    }
}

/// The stored state entries of the slot page that holds `key` (state keys), one by one; for a
/// key of a table not kept in pages, its own entry.
fn state_get_page(tree: &fjall::Keyspace, key: &[u8]) -> Result<anima_projections::cold::Entries, CheckpointError> {
    match slot_page::paged_key(key) {
        Some(paged) => match tree.get(state_key(&paged.page_key))? {
            Some(page) => Ok(slot_page::page_entries(&paged.page_key, &page)?),
            None => Ok(Vec::new()),
        },
        None => Ok(tree.get(state_key(key))?.map(|value| vec![(key.to_vec(), value.to_vec())]).unwrap_or_default()),
    }
}

/// Every stored state entry whose key starts with `prefix` (state keys), in key-byte order,
/// with the entries of slot pages given back one by one.
pub fn state_scan(tree: &fjall::Keyspace, prefix: &[u8]) -> Result<anima_projections::cold::Entries, CheckpointError> {
    scan_state_entries(|key| tree.prefix(key), prefix)
}

/// [`state_scan`] through `prefix_of`, which iterates the stored entries under a store key
/// prefix (of the tree as it is, or of one snapshot of the store).
fn scan_state_entries(
    prefix_of: impl Fn(Vec<u8>) -> fjall::Iter,
    prefix: &[u8],
) -> Result<anima_projections::cold::Entries, CheckpointError> {
    let mut out = Vec::new();
    for entry in prefix_of(state_key(prefix)) {
        let (key, value) = entry.into_inner()?;
        if !slot_page::is_page_tag(key.get(1).copied().unwrap_or(0)) {
            out.push((key[1..].to_vec(), value.to_vec()));
        }
    }
    let page_prefixes = slot_page::page_scan_prefixes(prefix);
    for page_prefix in &page_prefixes {
        for entry in prefix_of(state_key(page_prefix)) {
            let (page_key, page) = entry.into_inner()?;
            let entries = slot_page::page_entries(&page_key[1..], &page)?;
            out.extend(entries.into_iter().filter(|(key, _)| key.starts_with(prefix)));
        }
    }
    if !page_prefixes.is_empty() {
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    }
    Ok(out)
}

/// Commits `changes` to `tree` as one write batch. The entries of a paged table ([`slot_page`])
/// are applied to their pages: each changed page is read, patched with all of its changes and
/// written back once.
fn commit_changes(db: &fjall::Database, tree: &fjall::Keyspace, changes: &ChangeSet) -> Result<(), CheckpointError> {
    let mut pages: std::collections::BTreeMap<Vec<u8>, slot_page::PageChanges<'_>> = Default::default();
    let mut batch = db.batch();
    // What the batch writes by state table tag (pages counted whole, as they are written), for
    // the debug log: what the store's journal and merges have to carry.
    let mut written: Option<std::collections::BTreeMap<u8, (usize, usize)>> =
        tracing::enabled!(tracing::Level::DEBUG).then(Default::default);
    let mut count = |key: &[u8], value: Option<&[u8]>| {
        if let (Some(written), Some((&STATE_PREFIX, state))) = (written.as_mut(), key.split_first()) {
            let entry = written.entry(state.first().copied().unwrap_or(0)).or_default();
            entry.0 += 1;
            entry.1 += key.len() + value.map_or(0, <[u8]>::len);
        }
    };
    for (key, value) in changes.iter() {
        let paged = match key.split_first() {
            Some((&STATE_PREFIX, state)) => slot_page::paged_key(state),
            _ => None,
        };
        match (paged, value) {
            (Some(paged), _) => {
                pages.entry(state_key(&paged.page_key)).or_default().push((paged.index, value.as_deref()))
            }
            (None, Some(value)) => {
                count(key, Some(value));
                batch.insert(tree, key.as_slice(), value.as_slice())
            }
            (None, None) => {
                count(key, None);
                batch.remove(tree, key.as_slice())
            }
        }
    }
    for (page_key, changes) in pages {
        let old = tree.get(&page_key)?;
        match slot_page::page_apply(old.as_deref(), &changes)? {
            Some(page) => {
                count(&page_key, Some(&page));
                batch.insert(tree, page_key, page)
            }
            None => {
                count(&page_key, None);
                batch.remove(tree, page_key)
            }
        }
    }
    batch.commit()?;
    if let Some(written) = written {
        tracing::debug!(?written, "checkpoint batch by state table tag (entries, key and value bytes)");
    }
    Ok(())
}

/// Lowers the checkpoint store's own threads to [`CHECKPOINT_THREAD_NICE`], as the checkpoint
/// thread is (fjall names them `fjall:worker`; Linux lists a process's threads, with their
/// names, under `/proc/self/task`). Elsewhere they keep the default priority.
fn nice_store_threads() {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return };
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !comm.starts_with("fjall") {
            continue;
        }
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else { continue };
        if let Some(pid) = rustix::process::Pid::from_raw(tid) {
            let _ = rustix::process::setpriority_process(Some(pid), CHECKPOINT_THREAD_NICE);
        }
    }
}

/// Takes the next epoch of the checkpoint in `tree` and makes it durable.
/// Held while an epoch is taken and while a write checks it and applies (see EPOCH_KEY).
static EPOCH_GUARD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_epoch(tree: &fjall::Keyspace, db: &CheckpointDb) -> Result<u64, CheckpointError> {
    let _guard = EPOCH_GUARD.lock().unwrap_or_else(|p| p.into_inner());
    let next = tree.get(EPOCH_KEY)?.as_deref().map_or(0, decode_epoch) + 1;
    tree.insert(EPOCH_KEY, next.to_be_bytes())?;
    db.persist()?;
    Ok(next)
}

fn decode_epoch(bytes: &[u8]) -> u64 {
    bytes.try_into().map(u64::from_be_bytes).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    /// `len` bytes that do not compress (fjall compresses large values in its journal), from
    /// the seed `n`.
    fn noise(n: u8, len: usize) -> Vec<u8> {
        incompressible(u64::from(n) + 1, len)
    }

    /// Writes a checkpoint of `mib` entries of 1 MiB (subscriptions, tag 11, stored each as
    /// itself), their keys starting with `n`, then has fjall write the memtable out and waits
    /// until it has. A memtable that fills up is sealed by fjall's worker in its own time: left
    /// to it, the write-out could come after the next checkpoint, when the journal may have
    /// passed the rotation size, and the tests' journals would differ from run to run.
    async fn write_mib(store: &CheckpointStore, n: u8, mib: u8) {
        let changes = (0..mib).map(|i| (vec![11, n, i], Some(noise(n ^ i, MIB)))).collect();
        store.write(IDENTITY, changes, vec![], false).await.expect("checkpoint");
        store.tree.rotate_memtable_and_wait().expect("write out");
        let waited = Instant::now();
        while store.db.db.outstanding_flushes() > 0 || store.tree.sealed_memtable_count() > 0 {
            assert!(waited.elapsed() < std::time::Duration::from_secs(30), "fjall wrote its memtables out");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    fn open_store(dir: &std::path::Path) -> CheckpointStore {
        let db = CheckpointDb::open(dir, 16 * MIB as u64).expect("open");
        CheckpointStore::open(&db, "checkpoint").expect("store")
    }

    /// The stream the tests' checkpoints are taken on.
    const IDENTITY: &str = "stream";

    /// The store of `dir`, restored as a runner's start restores it (taking its epoch).
    async fn restored_store(dir: &std::path::Path) -> CheckpointStore {
        let store = open_store(dir);
        store.restore(IDENTITY).await.expect("restore");
        store
    }

    /// A journal just past fjall's rotation size that no write-out followed (large checkpoints,
    /// each written out, then one that stays in the memtable) is read whole by every open,
    /// until a stopping runner writes the memtable out: fjall then starts a new journal, and
    /// the next open reads none of the old one, with every entry still there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_past_fjalls_rotation_size_is_not_read_again_after_a_stop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = restored_store(dir.path()).await;
        // Six of 9.5 MiB (each fills the memtable and is written out while the journal is
        // under the size), then 4.5 MiB: 61.5 MiB, past 64,000,000 bytes.
        for n in 0..6 {
            write_mib(&store, n, 9).await;
            store
                .write(IDENTITY, vec![(vec![11, n, 200], Some(noise(n, MIB / 2)))], vec![], false)
                .await
                .expect("half");
        }
        let last = (0..4).map(|i| (vec![11, 6, i], Some(noise(6 ^ i, MIB)))).collect();
        store.write(IDENTITY, last, vec![], false).await.expect("checkpoint");
        store.write(IDENTITY, vec![(vec![11, 6, 200], Some(noise(6, MIB / 2)))], vec![], true).await.expect("half");
        drop(store);

        let store = open_store(dir.path());
        let long = journal_bytes(dir.path());
        assert!(long > FJALL_JOURNAL_ROTATION_BYTES, "the open read a journal of {long} bytes");
        let read = journal_files(dir.path());
        store.restore(IDENTITY).await.expect("restore");
        store.write_out_memtable("stop").await.expect("write out");
        for journal in &read {
            assert!(!journal.exists(), "the journal the open read ({}) was replaced and deleted", journal.display());
        }
        drop(store);

        let store = open_store(dir.path());
        let short = journal_bytes(dir.path());
        assert!(short < MIB as u64, "after the write-out the open read {short} bytes of journal, not {long}");
        for n in 0..=6u8 {
            for i in (0..if n < 6 { 9 } else { 4 }).chain([200]) {
                let value =
                    store.tree.get([STATE_PREFIX, 11, n, i]).expect("get").unwrap_or_else(|| panic!("entry {n}/{i}"));
                let written = if i == 200 { noise(n, MIB / 2) } else { noise(n ^ i, MIB) };
                assert!(*value == *written, "entry {n}/{i} as written");
            }
        }
    }

    /// The journal files in the store's folder, as the store itself lists them.
    fn journal_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
        let files: Vec<_> =
            journals(dir).into_iter().map(|(id, _)| dir.join(CHECKPOINT_DIR).join(format!("{id}.jnl"))).collect();
        assert!(files.iter().any(|file| file.exists()), "the store has a journal: {files:?}");
        files
    }

    /// A journal under fjall's rotation size (18.5 MiB of checkpoints) is padded up to it at a
    /// stop and replaced: the next open reads almost none of it, every entry reads back as
    /// written, and the store keeps none of the padding (not as an entry, not in its tables, not
    /// as a checkpoint).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_under_fjalls_rotation_size_is_padded_and_replaced_at_a_stop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = restored_store(dir.path()).await;
        for n in 0..2 {
            write_mib(&store, n, 9).await;
        }
        store.write(IDENTITY, vec![(vec![11, 2, 0], Some(noise(2, MIB / 2)))], vec![], true).await.expect("half");
        let (_, written) = active_journal(dir.path()).expect("a journal");
        assert!(
            (JOURNAL_PADDED_FROM..FJALL_JOURNAL_ROTATION_BYTES).contains(&written),
            "the checkpoints wrote {written} bytes of journal"
        );
        let read = journal_files(dir.path());
        store.write_out_memtable("stop").await.expect("write out");
        for journal in &read {
            assert!(!journal.exists(), "the journal ({}) was padded, replaced and deleted", journal.display());
        }
        // Against what the checkpoints wrote, not a reading taken before the stop: while fjall
        // merges tables, its count of their bytes can be short by a table.
        let checkpoints = 18 * MIB as u64 + MIB as u64 / 2;
        let tables = store.tree.disk_space();
        assert!(
            tables < checkpoints + MIB as u64,
            "the checkpoint's tables keep {tables} bytes for {checkpoints} bytes of checkpoints"
        );
        let padding = store.db.existing(JOURNAL_PADDING_KEYSPACE).expect("read").expect("the padding");
        assert!(padding.disk_space() < MIB as u64, "the padding's tables keep {} bytes", padding.disk_space());
        assert!(padding.get(JOURNAL_PADDING_KEY).expect("get").is_none(), "no padding is left as an entry");
        assert_eq!(store.db.names(), ["checkpoint"], "the padding is not a checkpoint");
        drop(padding);
        drop(store);

        let store = open_store(dir.path());
        let short = journal_bytes(dir.path());
        assert!(short < MIB as u64, "after the stop the open read {short} bytes of journal, not {written}");
        for n in 0..2u8 {
            for i in 0..9 {
                let value = store.tree.get([STATE_PREFIX, 11, n, i]).expect("get").expect("entry");
                assert!(*value == *noise(n ^ i, MIB), "entry {n}/{i} as written");
            }
        }
        let value = store.tree.get([STATE_PREFIX, 11, 2, 0]).expect("get").expect("entry");
        assert!(*value == *noise(2, MIB / 2), "the last checkpoint's entry as written");
    }
}
