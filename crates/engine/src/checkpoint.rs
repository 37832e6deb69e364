//! Checkpoints of the projection state in sled: only changed keys, together with the fold version
//! and the stream identity (the applied seq is part of the state's meta entry). A checkpoint from
//! another fold version or another stream is discarded and the state rebuilt from the log.
//!
//! A checkpoint is all or nothing without a sled batch. A sled batch takes sled's process-wide
//! lock exclusively, so a checkpoint of thousands of entries written as one stalled every other
//! sled operation of the process for its whole length — the log's appends, the fold's reads of
//! cold state, the body reads of rendering (under load, Sends of 100 ms or more were 70 times as
//! many as without it). Instead the whole change set is first written as one value
//! ([`PENDING_KEY`], a redo record), then applied entry by entry with plain inserts (which share
//! that lock), then the redo record is removed. sled recovers a prefix of its operations, so
//! after a crash the store holds either the previous checkpoint untouched (the redo record never
//! landed) or the redo record, which the next restore applies again, whole, before it reads
//! anything: never a mix.
//!
//! The entries of the tables keyed by (owner, slot) — a surface's rows and dedupe order, an
//! agent's settled-id order and queued items — are stored in pages of consecutive slots
//! (`anima_projections::slot_page`): a checkpoint reads each changed page, patches it and writes
//! it back once, and reads give the entries back one by one. Each sled write costs about 15,000
//! instructions (leaf splits above 16 entries rewrite the parent whole), and one per changed
//! entry made checkpoints the largest part of the engine's CPU under load.

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
/// A write checks it in the same transaction that applies it, so a runner that was replaced
/// (aborted while its write was still on the blocking pool, a crash simulated in-process) can
/// never land a write after its successor's: a checkpoint is never a mix of two runners.
pub const EPOCH_KEY: &[u8] = b"m:epoch";
/// The change set of the checkpoint being written, whole (postcard of its (key, value or removal)
/// pairs): written before its entries, removed after them (see the module's documentation).
pub const PENDING_KEY: &[u8] = b"m:pending";

/// The checkpoint trees of a data dir are named this, then the backend.
pub const CHECKPOINT_TREE_PREFIX: &str = "checkpoint-";
/// Name of the checkpoint tree of the embedded log in a data dir.
pub const EMBEDDED_CHECKPOINT_TREE: &str = "checkpoint-embedded";

/// Name of the checkpoint tree of a JetStream stream in a data dir.
pub fn jetstream_checkpoint_tree(stream: &str) -> String {
    format!("{CHECKPOINT_TREE_PREFIX}jetstream-{stream}")
}

/// A checkpoint's change set: full tree keys, each with its new value or `None` (removed).
type ChangeSet = Vec<(Vec<u8>, Option<Vec<u8>>)>;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// sled failed; the checkpoint was not written. The runner stops; restart rebuilds.
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
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

/// A sled tree holding one projection checkpoint.
#[derive(Clone)]
pub struct CheckpointStore {
    db: sled::Db,
    tree: sled::Tree,
    /// Set by fault injection: every later write fails without touching sled.
    fail_writes: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Set by fault injection: the next write stops after its redo record and this many
    /// entries, as a crash would leave it.
    tear_next_write_after: std::sync::Arc<std::sync::Mutex<Option<usize>>>,
    /// This store's epoch, taken by its last restore (0: never restored, writes take none).
    epoch: std::sync::Arc<std::sync::atomic::AtomicU64>,
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
    /// Opens (or creates) the checkpoint tree `name` in `db`.
    pub fn open(db: sled::Db, name: &str) -> Result<Self, CheckpointError> {
        let tree = db.open_tree(name)?;
        Ok(CheckpointStore {
            db,
            tree,
            fail_writes: Default::default(),
            tear_next_write_after: Default::default(),
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

    /// Fault injection for tests: the next write lands its redo record and its first `entries`
    /// entries, then fails with [`CheckpointError::Injected`] and writes nothing more, as a crash
    /// in the middle of a checkpoint leaves the store (flushed, so a reopen sees it).
    pub fn inject_torn_write(&self, entries: usize) {
        *self.tear_next_write_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(entries);
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
            // A checkpoint a crash interrupted is completed from its redo record first.
            if let Some(pending) = tree.get(PENDING_KEY)? {
                match postcard::from_bytes::<ChangeSet>(&pending) {
                    Ok(changes) => {
                        tracing::info!(entries = changes.len(), "completing the checkpoint a crash interrupted");
                        apply_changes(&tree, &changes, usize::MAX)?;
                        tree.remove(PENDING_KEY)?;
                        db.flush()?;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the interrupted checkpoint's redo record does not decode");
                        tree.clear()?;
                    }
                }
            }
            let version_ok = tree.get(FOLD_VERSION_KEY)?.as_deref() == Some(&FOLD_VERSION.to_be_bytes()[..]);
            let stream_ok = tree.get(STREAM_KEY)?.as_deref() == Some(stream_identity.as_bytes());
            if version_ok && stream_ok {
                let mut state = State::new();
                let mut intact = true;
                // What is hot comes into memory; the cold tables' entries stay in the store and
                // are read back when a decision needs them, so restart does not grow with them.
                let mut loaded = std::collections::BTreeMap::<u8, (usize, usize)>::new();
                // A table's entries are read, then loaded at once (`State::load_table_entries`).
                for tag in (0..=u8::MAX).filter(|tag| !State::is_cold_tag(*tag)) {
                    let mut entries = Vec::new();
                    for entry in tree.scan_prefix([STATE_PREFIX, tag]) {
                        let (key, value) = entry?;
                        entries.push((key.subslice(1, key.len() - 1), value));
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
            } else if !tree.is_empty() {
                tracing::info!(version_ok, stream_ok, "checkpoint is from another fold version or stream; rebuilding");
            }
            tree.clear()?;
            tree.insert(EPOCH_KEY, &epoch.to_be_bytes()[..])?;
            db.flush()?;
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
            for entry in tree.scan_prefix([ANALYTICS_PREFIX]) {
                let (key, value) = entry?;
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
    /// identity, all or nothing through the redo record (flushed when `durable`).
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
        let tear_after = self.tear_next_write_after.lock().unwrap_or_else(|p| p.into_inner()).take();
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
            let redo = postcard::to_stdvec(&changes).expect("a change set encodes");
            // Applied only while this runner still owns the checkpoint (see EPOCH_KEY): the
            // epoch is read and the write applied under the process's epoch guard, which a
            // restore takes too, so no restore can come between the check and the write. (Two
            // processes never share a data dir: sled locks it.) Not a sled transaction either: a
            // transaction reads every key it writes and buffers the whole write set, which under
            // load cost more CPU and memory than the rest of the checkpoint.
            {
                let _guard = EPOCH_GUARD.lock().unwrap_or_else(|p| p.into_inner());
                let stored = tree.get(EPOCH_KEY)?.as_deref().map_or(0, decode_epoch);
                if own != 0 && stored != own {
                    return Err(CheckpointError::Superseded { own, stored });
                }
                tree.insert(PENDING_KEY, redo)?;
                if let Some(entries) = tear_after {
                    apply_changes(&tree, &changes, entries)?;
                    db.flush()?;
                    return Err(CheckpointError::Injected);
                }
                apply_changes(&tree, &changes, usize::MAX)?;
                tree.remove(PENDING_KEY)?;
            }
            // Not flushed here: sled writes its buffers out within its flush interval, and a
            // checkpoint lost to a crash only means the restart refolds a little more of the log
            // (sled recovers a prefix of its operations, so what is restored is one whole
            // checkpoint, completed from its redo record if need be). The last checkpoint of a
            // stopping runner is flushed.
            if durable {
                db.flush()?;
            }
            Ok(())
        })
        .await?
    }

    /// The size of the data dir's sled files on disk (the database holding this checkpoint, and
    /// the embedded log when it is the backend), for the `anima_data_dir_bytes` gauge: sled's
    /// file grows far past what it holds under load (see `crate::compact`).
    pub fn data_dir_bytes(&self) -> Result<u64, CheckpointError> {
        Ok(self.db.size_on_disk()?)
    }

    /// The applied seq of the stored checkpoint (0 when none), for tools and tests.
    pub fn checkpointed_seq(&self) -> Result<u64, CheckpointError> {
        match self.tree.get([STATE_PREFIX, 0])? {
            Some(value) => {
                let mut state = State::new();
                state.load_entry(&[0], &value)?;
                Ok(state.meta.applied_seq)
            }
            None => Ok(0),
        }
    }
}

/// The checkpoint's state entries as the fold's cold store: entries let go of to keep memory under
/// the budget are read back from here (see `anima_projections::cold`). Reads are synchronous
/// (sled's page cache, else the file) and come only from the fold.
pub struct SledCold {
    tree: sled::Tree,
}

impl SledCold {
    pub fn new(store: &CheckpointStore) -> Self {
        SledCold { tree: store.tree.clone() }
    }
}

impl anima_projections::cold::ColdStore for SledCold {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        state_get(&self.tree, key).map_err(|e| e.to_string())
    }

    fn scan(&self, prefix: &[u8]) -> Result<anima_projections::cold::Entries, String> {
        state_scan(&self.tree, prefix).map_err(|e| e.to_string())
    }

    fn scan_after(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<anima_projections::cold::Entries, String> {
        if !slot_page::page_scan_prefixes(prefix).is_empty() {
            // A paged table's entries are inside its pages: scanned whole, then cut.
            let entries = state_scan(&self.tree, prefix).map_err(|e| e.to_string())?;
            return Ok(anima_projections::cold::page_of(entries, after, limit));
        }
        let start = match after {
            Some(after) => std::ops::Bound::Excluded(state_key(after)),
            None => std::ops::Bound::Included(state_key(prefix)),
        };
        let full_prefix = state_key(prefix);
        let mut out = Vec::new();
        for entry in self.tree.range((start, std::ops::Bound::Unbounded)) {
            let (key, value) = entry.map_err(|e| e.to_string())?;
            if !key.starts_with(&full_prefix) || out.len() >= limit {
                break;
            }
            out.push((key[1..].to_vec(), value.to_vec()));
        }
        Ok(out)
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
fn state_get(tree: &sled::Tree, key: &[u8]) -> Result<Option<Vec<u8>>, CheckpointError> {
    match slot_page::paged_key(key) {
        Some(paged) => match tree.get(state_key(&paged.page_key))? {
            Some(page) => Ok(slot_page::page_get(&page, paged.index)?),
            None => Ok(None),
        },
        None => Ok(tree.get(state_key(key))?.map(|v| v.to_vec())),
    }
}

/// Every stored state entry whose key starts with `prefix` (state keys), in key-byte order,
/// with the entries of slot pages given back one by one.
pub fn state_scan(tree: &sled::Tree, prefix: &[u8]) -> Result<anima_projections::cold::Entries, CheckpointError> {
    let mut out = Vec::new();
    for entry in tree.scan_prefix(state_key(prefix)) {
        let (key, value) = entry?;
        if !slot_page::is_page_tag(key.get(1).copied().unwrap_or(0)) {
            out.push((key[1..].to_vec(), value.to_vec()));
        }
    }
    let page_prefixes = slot_page::page_scan_prefixes(prefix);
    for page_prefix in &page_prefixes {
        for entry in tree.scan_prefix(state_key(page_prefix)) {
            let (page_key, page) = entry?;
            let entries = slot_page::page_entries(&page_key[1..], &page)?;
            out.extend(entries.into_iter().filter(|(key, _)| key.starts_with(prefix)));
        }
    }
    if !page_prefixes.is_empty() {
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    }
    Ok(out)
}

/// Applies the first `max` entries of `changes` to `tree`, one plain operation each (no batch:
/// see the module's documentation). The entries of a paged table ([`slot_page`]) are applied
/// to their pages: each changed page is read, patched with all of its changes and written back
/// once.
fn apply_changes(tree: &sled::Tree, changes: &ChangeSet, max: usize) -> Result<(), CheckpointError> {
    let mut pages: std::collections::BTreeMap<Vec<u8>, slot_page::PageChanges<'_>> = Default::default();
    for (key, value) in changes.iter().take(max) {
        let paged = match key.split_first() {
            Some((&STATE_PREFIX, state)) => slot_page::paged_key(state),
            _ => None,
        };
        match (paged, value) {
            (Some(paged), _) => {
                pages.entry(state_key(&paged.page_key)).or_default().push((paged.index, value.as_deref()))
            }
            (None, Some(value)) => drop(tree.insert(key, value.as_slice())?),
            (None, None) => drop(tree.remove(key)?),
        }
    }
    for (page_key, changes) in pages {
        let old = tree.get(&page_key)?;
        match slot_page::page_apply(old.as_deref(), &changes)? {
            Some(page) => drop(tree.insert(page_key, page)?),
            None => drop(tree.remove(page_key)?),
        }
    }
    Ok(())
}

/// Takes the next epoch of the checkpoint in `tree` and makes it durable.
/// Held while an epoch is taken and while a write checks it and applies (see EPOCH_KEY).
static EPOCH_GUARD: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_epoch(tree: &sled::Tree, db: &sled::Db) -> Result<u64, CheckpointError> {
    let _guard = EPOCH_GUARD.lock().unwrap_or_else(|p| p.into_inner());
    let next =
        tree.update_and_fetch(EPOCH_KEY, |old| Some((old.map_or(0, decode_epoch) + 1).to_be_bytes().to_vec()))?;
    db.flush()?;
    Ok(next.as_deref().map_or(1, decode_epoch))
}

fn decode_epoch(bytes: &[u8]) -> u64 {
    bytes.try_into().map(u64::from_be_bytes).unwrap_or(0)
}
