//! One engine instance: the data directory (sled: the embedded log, if used, and the
//! checkpoints), the log backend, the projection runner caught up with the log, and the command
//! side. The gateway starts one of these and serves it; tests and benchmarks can start several on
//! one JetStream stream.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use anima_projections::memory::MemoryConfig;

use crate::checkpoint::{CheckpointDb, CheckpointStore};
use crate::clock::{Clock, SystemClock};
use crate::log::embedded::{EmbeddedConfig, EmbeddedLog};
use crate::log::jetstream::{JetStreamConfig, JetStreamLog};
use crate::log::EventLog;
use crate::metrics::{AppendObserver, ObservedLog};
use crate::projection::{Runner, RunnerConfig, RunnerError};
use crate::{Engine, EngineConfig};

/// Which log the instance uses.
#[derive(Clone, Debug)]
pub enum Backend {
    /// The embedded sled log in the data directory.
    Embedded(EmbeddedConfig),
    JetStream(JetStreamConfig),
}

#[derive(Clone, Debug)]
pub struct InstanceConfig {
    /// Holds the embedded log (if used) and the checkpoints. Its stores lock it: one process at a
    /// time.
    pub data_dir: PathBuf,
    /// sled's page cache for the data dir, bytes (part of the engine's memory budget; sled's own
    /// default of 1 GiB is never left in force).
    pub sled_cache_bytes: u64,
    /// The checkpoint store's block cache, bytes (part of the engine's memory budget).
    pub checkpoint_cache_bytes: u64,
    pub backend: Backend,
    pub runner: RunnerConfig,
    pub engine: EngineConfig,
    /// How long start-up waits for the projection to catch up with the log.
    pub catch_up_wait: Duration,
    /// How often the recovery loop looks for running wakes whose heartbeat went silent and
    /// claims never started within their lease (`[wakes] recovery_tick_seconds`, default 30 s).
    pub recovery_interval: Duration,
    /// Told how long every append took (the gateway's metrics); none: appends are not timed.
    pub append_observer: Option<Arc<dyn AppendObserver>>,
    /// The `memoryCoherence` configuration to append when the log's differs; `None` leaves the
    /// log's (or the defaults) in force.
    pub memory: Option<MemoryConfig>,
    /// The do-not-contact lists of the configuration, appended when they differ from the log's.
    pub do_not_contact: anima_projections::do_not_contact::DoNotContact,
    /// How often the memory-pass scheduler ticks; `None`: this instance runs no scheduler.
    pub memory_tick: Option<Duration>,
    /// "Now" for the scheduler and the recovery loop (the embedded log has its own, in its
    /// config). The wall clock unless a test injects another.
    pub clock: Arc<dyn Clock>,
}

impl InstanceConfig {
    pub fn new(data_dir: impl Into<PathBuf>, backend: Backend) -> Self {
        InstanceConfig {
            data_dir: data_dir.into(),
            sled_cache_bytes: crate::data_dir::SLED_CACHE_BYTES_DEFAULT,
            checkpoint_cache_bytes: crate::checkpoint::CHECKPOINT_CACHE_BYTES_DEFAULT,
            backend,
            runner: RunnerConfig::default(),
            engine: EngineConfig::default(),
            catch_up_wait: Duration::from_secs(3600),
            recovery_interval: Duration::from_secs(30),
            append_observer: None,
            memory: None,
            do_not_contact: Default::default(),
            // Off unless asked for: the gateway turns it on from its configuration.
            memory_tick: None,
            clock: Arc::new(SystemClock),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("opening data dir {path}: {reason} (is another anima-wake using it?)")]
    DataDir { path: String, reason: String },
    /// Closing: the data dir was not let go (a handle still held somewhere).
    #[error(transparent)]
    Close(#[from] crate::data_dir::DataDirError),
    #[error(transparent)]
    Log(#[from] crate::log::LogError),
    #[error(transparent)]
    Runner(#[from] RunnerError),
    #[error("catching up with the log: {0}")]
    CatchUp(String),
}

/// A started instance. Cancel `shutdown` and await `runner` to stop it with a last checkpoint.
pub struct Instance {
    pub engine: Engine,
    /// The data dir this instance holds (sled's lock) until it is closed.
    pub data_dir: PathBuf,
    /// The runner's checkpoint store (for tools and fault injection).
    pub checkpoints: CheckpointStore,
    pub backend_name: &'static str,
    pub shutdown: CancellationToken,
    pub runner: tokio::task::JoinHandle<Result<(), RunnerError>>,
    /// The recovery loop; it ends with `shutdown`.
    pub recovery: tokio::task::JoinHandle<()>,
    /// The memory-pass scheduler, when this instance runs one; it ends with `shutdown`.
    pub scheduler: Option<tokio::task::JoinHandle<()>>,
    /// The data dir's sled database, held (with its lock) as long as the instance, whatever
    /// the backend.
    sled: sled::Db,
}

impl Instance {
    /// Opens the data dir and the log, restores the projection and waits until it has applied
    /// everything the log held at start.
    pub async fn start(config: InstanceConfig) -> Result<Instance, InstanceError> {
        let _small_pages = crate::startup_pages::SmallPagesWhileStarting::begin();
        let data_dir_error =
            |reason: String| InstanceError::DataDir { path: config.data_dir.display().to_string(), reason };
        // The checkpoint store opens while sled and the log do: it reads its whole journal when
        // it opens (most of a restart's time on a large history), and nothing it does depends on
        // them. Its result is taken only after sled's, so a data dir another instance holds is
        // reported as sled reports it (the store has a lock of its own and fails too).
        let checkpoint_db = {
            let (data_dir, cache_bytes) = (config.data_dir.clone(), config.checkpoint_cache_bytes);
            // fjall creates the folders it opens, the data dir included.
            tokio::task::spawn_blocking(move || CheckpointDb::open(&data_dir, cache_bytes))
        };
        let opened = match crate::data_dir::open(&config.data_dir, config.sled_cache_bytes, true) {
            Ok(db) => Self::open_log(&config, &db).await.map(|log| (db, log)),
            Err(e) => Err(data_dir_error(e.to_string())),
        };
        let checkpoint_db = checkpoint_db
            .await
            .map_err(|e| data_dir_error(format!("opening the checkpoint store: {e}")))?
            .map_err(|e| data_dir_error(e.to_string()));
        let (db, (log, checkpoint_tree, backend_name)) = opened?;
        drop_sled_checkpoints(&db).map_err(|e| data_dir_error(e.to_string()))?;
        let checkpoint_db = checkpoint_db?;
        let checkpoints =
            CheckpointStore::open(&checkpoint_db, &checkpoint_tree).map_err(|e| data_dir_error(e.to_string()))?;
        let shutdown = CancellationToken::new();
        let Runner { projection, task, .. } =
            Runner::start(log.clone(), checkpoints.clone(), config.runner, shutdown.clone()).await?;
        let last = log.last_seq().await?;
        tracing::info!(from = projection.applied_seq(), to = last, backend = backend_name, "catching up with the log");
        projection.wait_applied(last, config.catch_up_wait).await.map_err(|e| InstanceError::CatchUp(e.to_string()))?;
        // One clock for the instance: the engine's heartbeat rate limit reads the same "now" as
        // its loops.
        let engine_config = EngineConfig { clock: config.clock.clone(), ..config.engine };
        let engine = Engine::new(log, projection, engine_config);
        if engine
            .sync_do_not_contact(&config.do_not_contact)
            .await
            .map_err(|e| InstanceError::CatchUp(e.to_string()))?
        {
            tracing::info!("doNotContact lists appended to the log");
        }
        if let Some(memory) = &config.memory {
            if engine.sync_memory_config(memory).await.map_err(|e| InstanceError::CatchUp(e.to_string()))? {
                tracing::info!("memoryCoherence configuration appended to the log");
            }
        }
        let recovery = tokio::spawn(crate::command::run_recovery_loop(
            engine.clone(),
            config.clock.clone(),
            config.recovery_interval,
            shutdown.clone(),
        ));
        let scheduler = config.memory_tick.map(|interval| {
            tokio::spawn(crate::memory::run_memory_scheduler(
                engine.clone(),
                config.clock.clone(),
                interval,
                shutdown.clone(),
            ))
        });
        Ok(Instance {
            engine,
            data_dir: config.data_dir,
            checkpoints,
            backend_name,
            shutdown,
            runner: task,
            recovery,
            scheduler,
            sled: db,
        })
    }

    /// Opens the log of `config`'s backend (the embedded one in `db`), behind the append
    /// observer if one is configured. Gives the log, the name of its checkpoint and the
    /// backend's name.
    async fn open_log(
        config: &InstanceConfig,
        db: &sled::Db,
    ) -> Result<(Arc<dyn EventLog>, String, &'static str), InstanceError> {
        let (log, checkpoint_tree, backend_name): (Arc<dyn EventLog>, String, &'static str) = match &config.backend {
            Backend::Embedded(embedded) => (
                Arc::new(EmbeddedLog::open(db.clone(), embedded.clone())?),
                crate::checkpoint::EMBEDDED_CHECKPOINT_TREE.to_owned(),
                "embedded",
            ),
            Backend::JetStream(jetstream) => (
                Arc::new(JetStreamLog::connect(jetstream.clone()).await?),
                crate::checkpoint::jetstream_checkpoint_tree(&jetstream.stream),
                "jetstream",
            ),
        };
        let log: Arc<dyn EventLog> = match &config.append_observer {
            Some(observer) => Arc::new(ObservedLog::new(log, observer.clone())),
            None => log,
        };
        Ok((log, checkpoint_tree, backend_name))
    }

    /// Stops the runner, writing a last checkpoint. The data dir stays locked until every clone
    /// of the engine is gone; [`Instance::close`] waits for that.
    pub async fn stop(self) -> Result<(), InstanceError> {
        self.stop_tasks().await.map(drop)
    }

    /// Stops like [`Instance::stop`], then waits (at most `timeout`) until sled has let go of the
    /// data dir, so it can be opened again at once — by a restart, the replay tool or a test. Every
    /// clone of `engine` must be dropped before, or this reports the directory as not released.
    pub async fn close(self, timeout: Duration) -> Result<(), InstanceError> {
        let data_dir = self.stop_tasks().await?;
        tokio::task::spawn_blocking(move || crate::data_dir::wait_until_released(&data_dir, timeout))
            .await
            .map_err(|e| InstanceError::CatchUp(format!("close task: {e}")))??;
        Ok(())
    }

    /// Ends the loops and the runner (a last checkpoint) and drops this instance's engine.
    async fn stop_tasks(self) -> Result<PathBuf, InstanceError> {
        let Instance { engine, data_dir, checkpoints, shutdown, runner, recovery, scheduler, sled, .. } = self;
        drop(checkpoints);
        shutdown.cancel();
        let _ = recovery.await;
        if let Some(scheduler) = scheduler {
            let _ = scheduler.await;
        }
        drop(engine);
        match runner.await {
            Ok(result) => result?,
            Err(e) => return Err(InstanceError::CatchUp(format!("runner task: {e}"))),
        }
        drop(sled);
        Ok(data_dir)
    }
}

/// Drops the checkpoints an earlier version kept in the sled database (trees named
/// `checkpoint-…`): checkpoints now live in their own store, and the first start on such a data
/// dir rebuilds its state from the log. What they took in sled's file is given back by
/// `anima-wake compact`.
fn drop_sled_checkpoints(db: &sled::Db) -> Result<(), sled::Error> {
    for name in db.tree_names() {
        if name.starts_with(crate::checkpoint::CHECKPOINT_TREE_PREFIX.as_bytes()) {
            tracing::info!(
                tree = %String::from_utf8_lossy(&name),
                "dropping a checkpoint kept in sled by an earlier version; the state is rebuilt from the log"
            );
            db.drop_tree(&name)?;
        }
    }
    Ok(())
}
