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
/// checkpoint store"); 4 MiB with the 8 MiB memtables above (stop 47).
const TABLE_BYTES: u64 = 4 * 1024 * 1024;
/// How long [`CheckpointStore::write_out_memtable`] waits for fjall to delete the journal it
/// replaced.
const JOURNAL_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
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
        tracing::info!(
            journal_mib = %format_args!("{:.1}", journal_bytes as f64 / (1024.0 * 1024.0)),
            open_ms = %format_args!("{:.0}", started.elapsed().as_secs_f64() * 1e3),
            "checkpoint store opened (it reads its whole journal to open)"
        );
        Ok(CheckpointDb { db, data_dir: data_dir.to_owned() })
    }

    /// Whether the data dir holds a checkpoint store (the tools read one only if so).
    pub fn exists(data_dir: &std::path::Path) -> bool {
        data_dir.join(CHECKPOINT_DIR).is_dir()
    }

    /// The names of the checkpoints the store holds.
    pub fn names(&self) -> Vec<String> {
        self.db.list_keyspace_names().iter().map(|name| (**name).to_owned()).collect()
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
/// an entry (README, "The scale figure"). fjall starts a new journal file only once the current
/// one has passed 64 MB, so a journal of any size up to that is normal. A journal file fjall
/// started is made 64 MiB long at once, and an open cuts it to what was written: measured right
/// after an open, this is what the open read; before, it may be that first length.
fn journal_bytes(data_dir: &std::path::Path) -> u64 {
    let Ok(files) = std::fs::read_dir(data_dir.join(CHECKPOINT_DIR)) else { return 0 };
    files
        .flatten()
        .filter(|file| file.path().extension().is_some_and(|extension| extension == "jnl"))
        .filter_map(|file| file.metadata().ok())
        .map(|metadata| metadata.len())
        .sum()
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

    /// Writes the store's memtable out to a table and waits until that is done: what a stopping
    /// runner does after its last checkpoint. fjall starts a new journal file only when it
    /// writes a memtable out while the current journal has passed 64,000,000 bytes (a constant
    /// in fjall 3.1.13's worker, not a setting), and deletes the old file once everything in it
    /// is in tables; every open reads the whole journal, about 1.2–1.9 µs an entry. An engine that wrote large checkpoints and then
    /// little (after a rebuild or a long catch-up; the scale figure's history is written so)
    /// kept a journal just past that size, which nothing wrote out while it ran, and read it
    /// again at every start: 1.0 s of a 1.1–1.2 s restart (README, "The scale figure", stop
    /// 53). Written out here, the journal starts anew and the next open reads none of it. A
    /// journal under that size stays as it is (fjall has no call that starts a new one), so
    /// this costs only the write-out of a memtable (at most [`MEMTABLE_BYTES`]) then.
    pub async fn write_out_memtable(&self) -> Result<(), CheckpointError> {
        let (tree, db) = (self.tree.clone(), self.db.clone());
        self.background(move || {
            // `rotate_memtable_and_wait` is hidden from fjall's docs ("used in tests"): pinned by
            // the lock file; a test below fails if it stops starting a new journal.
            tree.rotate_memtable_and_wait()?;
            // The old journal file is deleted just after the write-out: waited for (briefly),
            // so the process does not stop in between.
            let waited = Instant::now();
            while db.db.journal_count() > 1 && waited.elapsed() < JOURNAL_RELEASE_WAIT {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Ok(())
        })
        .await?
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
    /// See [`CheckpointStore::write_out_memtable`].
    const FJALL_JOURNAL_ROTATION_BYTES: u64 = 64_000_000;

    /// `len` bytes that do not compress (fjall compresses large values in its journal), from
    /// the seed `n`.
    fn noise(n: u8, len: usize) -> Vec<u8> {
        let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(n + 1);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Writes a checkpoint of `mib` entries of 1 MiB (subscriptions, tag 11, stored each as
    /// itself), their keys starting with `n`, then waits until fjall has written out every
    /// memtable that filled up.
    async fn write_mib(store: &CheckpointStore, identity: &str, n: u8, mib: u8) {
        let changes = (0..mib).map(|i| (vec![11, n, i], Some(noise(n ^ i, MIB)))).collect();
        store.write(identity, changes, vec![], false).await.expect("checkpoint");
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

    /// A journal just past fjall's rotation size that no write-out followed (large checkpoints,
    /// each written out, then one that stays in the memtable) is read whole by every open,
    /// until a stopping runner writes the memtable out: fjall then starts a new journal, and
    /// the next open reads none of the old one, with every entry still there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_past_fjalls_rotation_size_is_not_read_again_after_a_stop() {
        let dir = tempfile::tempdir().expect("tempdir");
        let identity = "stream";
        let store = open_store(dir.path());
        store.restore(identity).await.expect("restore");
        // Six of 9.5 MiB (each fills the memtable and is written out while the journal is
        // under the size), then 4.5 MiB: 61.5 MiB, past 64,000,000 bytes.
        for n in 0..6 {
            write_mib(&store, identity, n, 9).await;
            store
                .write(identity, vec![(vec![11, n, 200], Some(noise(n, MIB / 2)))], vec![], false)
                .await
                .expect("half");
        }
        write_mib(&store, identity, 6, 4).await;
        store.write(identity, vec![(vec![11, 6, 200], Some(noise(6, MIB / 2)))], vec![], true).await.expect("half");
        drop(store);

        let store = open_store(dir.path());
        let long = journal_bytes(dir.path());
        assert!(long > FJALL_JOURNAL_ROTATION_BYTES, "the open read a journal of {long} bytes");
        let read: Vec<_> = std::fs::read_dir(dir.path().join(CHECKPOINT_DIR))
            .expect("the store's folder")
            .flatten()
            .map(|file| file.path())
            .filter(|path| path.extension().is_some_and(|extension| extension == "jnl"))
            .collect();
        store.restore(identity).await.expect("restore");
        store.write_out_memtable().await.expect("write out");
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
}
