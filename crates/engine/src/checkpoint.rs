//! Checkpoints of the projection state in sled: only changed keys, written in one atomic batch
//! together with the fold version and the stream identity (the applied seq is part of the
//! state's meta entry). A checkpoint from another fold version or another stream is discarded and
//! the state rebuilt from the log.

use anima_projections::state::{State, FOLD_VERSION};

/// Prefix of state entries; the rest of the key is the state's own checkpoint key.
pub const STATE_PREFIX: u8 = b's';
/// Prefix of the maintained analytics counters (one entry per time bucket).
pub const ANALYTICS_PREFIX: u8 = b'a';
/// The fold version the checkpoint was taken by (big-endian u32).
pub const FOLD_VERSION_KEY: &[u8] = b"m:fold_version";
/// The identity of the stream the checkpoint was taken on.
pub const STREAM_KEY: &[u8] = b"m:stream";

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
    /// A stored entry does not decode: the checkpoint is unusable (the runner rebuilds).
    #[error(transparent)]
    Decode(#[from] anima_projections::state::CheckpointDecodeError),
}

/// A sled tree holding one projection checkpoint.
#[derive(Clone)]
pub struct CheckpointStore {
    db: sled::Db,
    tree: sled::Tree,
    /// Set by fault injection: every later write fails without touching sled.
    fail_writes: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl CheckpointStore {
    /// Opens (or creates) the checkpoint tree `name` in `db`.
    pub fn open(db: sled::Db, name: &str) -> Result<Self, CheckpointError> {
        let tree = db.open_tree(name)?;
        Ok(CheckpointStore { db, tree, fail_writes: Default::default() })
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
        let stream_identity = stream_identity.to_owned();
        tokio::task::spawn_blocking(move || {
            let version_ok = tree.get(FOLD_VERSION_KEY)?.as_deref() == Some(&FOLD_VERSION.to_be_bytes()[..]);
            let stream_ok = tree.get(STREAM_KEY)?.as_deref() == Some(stream_identity.as_bytes());
            if version_ok && stream_ok {
                let mut state = State::new();
                let mut intact = true;
                for entry in tree.scan_prefix([STATE_PREFIX]) {
                    let (key, value) = entry?;
                    if let Err(e) = state.load_entry(&key[1..], &value) {
                        tracing::warn!(error = %e, "checkpoint entry does not decode; rebuilding from the log");
                        intact = false;
                        break;
                    }
                }
                if intact {
                    return Ok(state);
                }
            } else if !tree.is_empty() {
                tracing::info!(version_ok, stream_ok, "checkpoint is from another fold version or stream; rebuilding");
            }
            tree.clear()?;
            Ok(State::new())
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
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
    /// identity in one batch, flushed.
    pub async fn write(
        &self,
        stream_identity: &str,
        changes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
        analytics_changes: Vec<(Vec<u8>, Option<Vec<u8>>)>,
    ) -> Result<(), CheckpointError> {
        if self.fail_writes.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(CheckpointError::Injected);
        }
        let db = self.db.clone();
        let tree = self.tree.clone();
        let stream_identity = stream_identity.to_owned();
        tokio::task::spawn_blocking(move || {
            let mut batch = sled::Batch::default();
            let prefixed = changes
                .into_iter()
                .map(|change| (STATE_PREFIX, change))
                .chain(analytics_changes.into_iter().map(|change| (ANALYTICS_PREFIX, change)));
            for (prefix, (key, value)) in prefixed {
                let mut full = Vec::with_capacity(key.len() + 1);
                full.push(prefix);
                full.extend(key);
                match value {
                    Some(value) => batch.insert(full, value),
                    None => batch.remove(full),
                }
            }
            batch.insert(FOLD_VERSION_KEY, &FOLD_VERSION.to_be_bytes()[..]);
            batch.insert(STREAM_KEY, stream_identity.as_bytes());
            tree.apply_batch(batch)?;
            db.flush()?;
            Ok(())
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
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
