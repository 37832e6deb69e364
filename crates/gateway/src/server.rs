//! Starting and stopping one engine instance: open the log (embedded sled under the data dir, or
//! JetStream), restore the projection from its checkpoint and catch up, append configured agents
//! that differ from the log, then serve gRPC (over TLS when a certificate is configured) and, when
//! configured, Prometheus metrics until shutdown. Shutdown stops accepting, ends streams, writes a
//! last checkpoint, and returns.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anima_engine::instance::{Backend, Instance, InstanceConfig};
use anima_engine::log::embedded::EmbeddedConfig;
use anima_engine::log::jetstream::JetStreamConfig;
use anima_engine::{Engine, EngineConfig, RunnerConfig};
use anima_projections::proto as events;
use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::api;
use crate::auth::{Auth, AuthLayer};
use crate::config::Config;
use crate::memory_services::MemoryService;
use crate::metrics::{Metrics, RefusalLayer};
use crate::replay_services::ReplayServices;
use crate::services::Services;

/// How long shutdown waits for in-flight requests before closing connections.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// How long a client may take over its TLS handshake before the connection is dropped.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Every service the server registers in health: the overall status ("") and each API service.
const SERVED_SERVICES: [&str; 8] = [
    "",
    <api::ingest_server::IngestServer<Services> as tonic::server::NamedService>::NAME,
    <api::wakes_server::WakesServer<Services> as tonic::server::NamedService>::NAME,
    <api::sends_server::SendsServer<Services> as tonic::server::NamedService>::NAME,
    <api::subscriptions_server::SubscriptionsServer<Services> as tonic::server::NamedService>::NAME,
    <api::memory_server::MemoryServer<MemoryService> as tonic::server::NamedService>::NAME,
    <api::replay_server::ReplayServer<ReplayServices> as tonic::server::NamedService>::NAME,
    <api::analytics_server::AnalyticsServer<ReplayServices> as tonic::server::NamedService>::NAME,
];

/// Shutdown started: every service reports NOT_SERVING, and open `Health.Watch` streams end after
/// telling their watcher so (they would otherwise hold the drain open until its deadline). A
/// `Check` still answers NOT_SERVING until the connection closes.
async fn report_draining(health: &tonic_health::server::HealthReporter) {
    let mut health = health.clone();
    for service in SERVED_SERVICES {
        health.set_service_status(service, tonic_health::ServingStatus::NotServing).await;
    }
    for service in SERVED_SERVICES {
        // Dropping a status's channel ends its watch streams once they have sent the last value.
        health.clear_service_status(service).await;
        health.set_service_status(service, tonic_health::ServingStatus::NotServing).await;
    }
}

// HTTP/2 limits. h2 (0.4) closes a connection with GOAWAY `too_many_data_frames`
// (ENHANCE_YOUR_CALM) when the DATA frames it has received but the application has not yet read
// cost more than a budget: a frame with a payload of p < 256 bytes costs 256 - p, and the budget
// is half the connection's target window (at least 25,600). Flow control bounds the unread bytes,
// not the frames, so with the defaults (1 MiB connection and stream windows, so a budget of
// 512 KiB) about 340 KB of ~90-byte messages unread — a gRPC client that sends each small message
// in its own frame while the server is busy, e.g. grpcio streaming into AppendStream on a loaded
// machine — ended the connection. So the stream windows bound what may sit unread
// (concurrent streams × stream window), and the connection window is set so large that its
// budget covers all of that even in frames of HTTP2_FRAME_BYTES_MIN bytes. Memory stays bounded
// by the stream windows: at most 16 MiB of unread request data per connection.

/// The stream flow-control window: HTTP/2's default, what a client may send before it has read
/// our settings anyway.
const HTTP2_STREAM_WINDOW_BYTES: u32 = 65_535;

/// Concurrent streams (calls) per connection; a client queues more until one ends.
const HTTP2_CONCURRENT_STREAMS_MAX: u32 = 256;

/// The connection flow-control window: never the binding limit (the stream windows are); large so
/// that h2's small-frame budget (half of it) covers everything the stream windows let in.
const HTTP2_CONNECTION_WINDOW_BYTES: u32 = 256 * 1024 * 1024;

/// The smallest DATA frame payload that can never trip h2's small-frame budget with the settings
/// above. gRPC clients put a whole message (or several) in a frame, except at window edges, and
/// every AppendStream request with a valid Slack, chat or Linear observation is larger; a flood of
/// tinier frames is what the guard is for.
const HTTP2_FRAME_BYTES_MIN: u64 = 29;

/// h2's per-frame accounting: frames below this many payload bytes cost the difference.
const H2_FRAME_OVERHEAD_BYTES: u64 = 256;

const _: () = {
    let unread_bytes_max = HTTP2_CONCURRENT_STREAMS_MAX as u64 * HTTP2_STREAM_WINDOW_BYTES as u64;
    let frames_max = unread_bytes_max / HTTP2_FRAME_BYTES_MIN;
    let budget = HTTP2_CONNECTION_WINDOW_BYTES as u64 / 2;
    assert!(frames_max * (H2_FRAME_OVERHEAD_BYTES - HTTP2_FRAME_BYTES_MIN) <= budget);
    assert!(HTTP2_CONNECTION_WINDOW_BYTES as u64 >= unread_bytes_max);
};

/// The file in the data dir that says where the server holding the dir serves gRPC, so that
/// `anima-wake replay --data DIR` reaches that server and no other.
pub const SERVING_FILE: &str = "anima-wake.serving";

/// What [`SERVING_FILE`] says: the process, its gRPC address, and whether it serves TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServingRecord {
    pub pid: u32,
    pub grpc: SocketAddr,
    pub tls: bool,
}

impl ServingRecord {
    pub fn encode(&self) -> String {
        format!("pid {}\ngrpc {}\ntls {}\n", self.pid, self.grpc, self.tls)
    }

    /// `None` unless the text is exactly what [`ServingRecord::encode`] writes.
    pub fn decode(text: &str) -> Option<ServingRecord> {
        let mut lines = text.lines();
        let pid = lines.next()?.strip_prefix("pid ")?.parse().ok()?;
        let grpc = lines.next()?.strip_prefix("grpc ")?.parse().ok()?;
        let tls = lines.next()?.strip_prefix("tls ")?.parse().ok()?;
        lines.next().is_none().then_some(ServingRecord { pid, grpc, tls })
    }
}

/// A running server.
pub struct RunningServer {
    pub local_addr: SocketAddr,
    /// Where `/metrics` is served, when `metrics_listen` is configured.
    pub metrics_addr: Option<SocketAddr>,
    pub engine: Engine,
    pub metrics: Arc<Metrics>,
    /// The runner's checkpoint store (fault injection in tests).
    pub checkpoints: anima_engine::checkpoint::CheckpointStore,
    shutdown: CancellationToken,
    serve: tokio::task::JoinHandle<anyhow::Result<()>>,
    serve_metrics: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    /// The tasks the instance cannot serve without; `None` once joined.
    runner: Option<tokio::task::JoinHandle<Result<(), anima_engine::projection::RunnerError>>>,
    recovery: Option<tokio::task::JoinHandle<()>>,
    scheduler: Option<tokio::task::JoinHandle<()>>,
    serving_file: std::path::PathBuf,
}

/// Why a server stopped on its own: a task it cannot serve without ended.
#[derive(Debug, thiserror::Error)]
pub enum SupervisionError {
    /// The projection runner failed: this instance could not decide anything any more. It
    /// drained and exited; an orchestrator restarts it (the restart restores and catches up).
    #[error("the projection runner failed: {0}")]
    RunnerFailed(String),
    /// A loop the instance needs (recovery, memory-pass scheduler, the runner) ended without
    /// being asked to, or panicked.
    #[error("the {task} ended unexpectedly: {reason}")]
    TaskEnded { task: &'static str, reason: String },
}

/// The end of a supervised task, or never when there is none (already joined, or not run).
async fn joined<T>(task: Option<&mut tokio::task::JoinHandle<T>>) -> Result<T, tokio::task::JoinError> {
    match task {
        Some(task) => task.await,
        None => std::future::pending().await,
    }
}

/// The reason a supervised task gave for ending.
fn ended(task: &'static str, joined: Result<(), tokio::task::JoinError>) -> SupervisionError {
    let reason = match joined {
        Ok(()) => "it returned".to_owned(),
        Err(e) => e.to_string(),
    };
    SupervisionError::TaskEnded { task, reason }
}

impl RunningServer {
    /// Stops accepting, waits for in-flight work up to a deadline, checkpoints, and returns.
    pub async fn shutdown(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        let runner = match self.runner.take() {
            Some(runner) => runner.await.context("runner task")?,
            None => Ok(()),
        };
        self.serve.await.context("server task")??;
        if let Some(mut serve_metrics) = self.serve_metrics {
            // A scraper holding its connection open must not hold up shutdown.
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut serve_metrics).await {
                Ok(result) => result.context("metrics task")??,
                Err(_) => {
                    tracing::warn!("metrics connections still open after the grace period; closing them");
                    serve_metrics.abort();
                }
            }
        }
        if let Some(recovery) = self.recovery {
            recovery.await.context("recovery task")?;
        }
        if let Some(scheduler) = self.scheduler {
            scheduler.await.context("memory-pass scheduler task")?;
        }
        // Still holding the data dir: nobody else wrote it meanwhile.
        if let Err(e) = std::fs::remove_file(&self.serving_file) {
            tracing::warn!(path = %self.serving_file.display(), error = %e, "removing the serving file");
        }
        runner?;
        Ok(())
    }

    /// Serves until `signal` fires (then shuts down cleanly), or until a task the instance needs
    /// ends on its own — the runner failing (a checkpoint write, an unreadable log), or a loop
    /// panicking. Then it does not stay up useless: health goes NOT_SERVING, waiting requests
    /// are answered UNAVAILABLE with the cause, the server drains, and this returns the cause as
    /// an error so the process exits non-zero and an orchestrator restarts it.
    pub async fn run_until(mut self, signal: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        let failure = {
            let runner = joined(self.runner.as_mut());
            let recovery = joined(self.recovery.as_mut());
            let scheduler = joined(self.scheduler.as_mut());
            tokio::select! {
                _ = signal => None,
                joined = runner => Some(("runner", match joined {
                    Ok(Ok(())) => SupervisionError::TaskEnded { task: "projection runner", reason: "it returned".into() },
                    Ok(Err(e)) => SupervisionError::RunnerFailed(e.to_string()),
                    Err(e) => SupervisionError::RunnerFailed(e.to_string()),
                })),
                joined = recovery => Some(("recovery", ended("recovery loop", joined))),
                joined = scheduler => Some(("scheduler", ended("memory-pass scheduler", joined))),
            }
        };
        let Some((which, failure)) = failure else {
            tracing::info!("shutting down");
            return self.shutdown().await;
        };
        tracing::error!(error = %failure, "a task this instance needs ended; draining and exiting");
        // The task that ended was joined; the rest end with the shutdown token.
        match which {
            "runner" => self.runner = None,
            "recovery" => self.recovery = None,
            _ => self.scheduler = None,
        }
        if let Err(e) = self.shutdown().await {
            tracing::warn!(error = %e, "draining after the failure");
        }
        Err(failure.into())
    }
}

/// Starts an engine instance and its gRPC server.
pub async fn start(config: Config) -> anyhow::Result<RunningServer> {
    config.validate()?;
    if !config.runner.transparent_huge_pages {
        anima_engine::startup_pages::small_pages_from_now_on();
    }
    let auth = Auth::new(&config.tokens)?;
    let subject_prefix = config.checked_subject_prefix()?;
    let backend = match &config.nats {
        Some(url) => Backend::JetStream(JetStreamConfig {
            url: url.clone(),
            stream: config.stream.clone(),
            subject_prefix,
            replicas: config.replicas,
            ..JetStreamConfig::default()
        }),
        // A server appends soon after it starts: its first append after a restart waits
        // only for what is left of the window's read.
        None => {
            Backend::Embedded(EmbeddedConfig { subject_prefix, read_window_at_open: true, ..EmbeddedConfig::default() })
        }
    };
    let mut instance_config = InstanceConfig::new(&config.data, backend);
    instance_config.runner = RunnerConfig {
        checkpoint_every_events: config.runner.checkpoint_every_events,
        checkpoint_interval: config.checkpoint_interval(),
        body_cache_bytes_max: usize::try_from(config.runner.body_cache_mib * 1024 * 1024).unwrap_or(usize::MAX),
        state_bytes_max: usize::try_from(config.runner.state_bytes_max()).unwrap_or(usize::MAX),
        process_bytes_max: usize::try_from(config.runner.memory_budget_mib * 1024 * 1024).unwrap_or(usize::MAX),
        ..RunnerConfig::default()
    };
    instance_config.sled_cache_bytes = config.runner.sled_cache_mib * 1024 * 1024;
    instance_config.checkpoint_cache_bytes = config.runner.checkpoint_cache_mib * 1024 * 1024;
    instance_config.recovery_interval = Duration::from_secs(config.wakes.recovery_tick_seconds);
    instance_config.engine = EngineConfig {
        verdict_wait: Duration::from_millis(config.runner.verdict_wait_ms),
        claim_lease: Duration::from_secs(config.wakes.claim_lease_seconds),
        ..EngineConfig::default()
    };
    let metrics = Arc::new(Metrics::new());
    instance_config.append_observer = Some(metrics.clone());
    instance_config.memory = Some(config.memory_coherence.to_config()?);
    instance_config.do_not_contact = config.do_not_contact_config()?;
    instance_config.memory_tick = config.memory_coherence.tick();
    // Read and checked before the log is opened, so a bad certificate fails start-up at once.
    let tls = match config.tls_files() {
        Some((cert, key)) => {
            let cert = std::fs::read(cert).with_context(|| format!("tls_cert: reading {}", cert.display()))?;
            let key = std::fs::read(key).with_context(|| format!("tls_key: reading {}", key.display()))?;
            let identity = tonic::transport::Identity::from_pem(cert, key);
            Some(tonic::transport::ServerTlsConfig::new().identity(identity).timeout(TLS_HANDSHAKE_TIMEOUT))
        }
        None => None,
    };
    let mut builder = tonic::transport::Server::builder()
        .initial_stream_window_size(HTTP2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES)
        .max_concurrent_streams(HTTP2_CONCURRENT_STREAMS_MAX);
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).context("tls_cert, tls_key: not a usable PEM certificate chain and key")?;
    }
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(crate::metrics::bind(addr).await?),
        None => None,
    };
    let Instance { engine, checkpoints, backend_name, shutdown, runner, recovery, scheduler, .. } =
        Instance::start(instance_config).await?;
    let configured: Vec<events::AgentRegistered> = config
        .agents
        .iter()
        .map(|a| events::AgentRegistered {
            agent_id: a.id.clone(),
            slack_bot_user_id: a.slack_bot_user_id.clone(),
            slack_bot_id: a.slack_bot_id.clone(),
            display_name: a.display_name.clone(),
            chat_user_id: a.chat_user_id.clone(),
        })
        .collect();
    let appended =
        engine.sync_agents(&configured).await.map_err(|e| anyhow::anyhow!("registering configured agents: {e}"))?;
    if appended > 0 {
        tracing::info!(appended, "configured agents appended to the log");
    }

    let listener =
        tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let local_addr = listener.local_addr()?;
    // Written while this process holds the data dir (the instance opened it above).
    let serving_file = config.data.join(SERVING_FILE);
    let record = ServingRecord { pid: std::process::id(), grpc: local_addr, tls: config.tls_files().is_some() };
    std::fs::write(&serving_file, record.encode())
        .with_context(|| format!("data: writing {}", serving_file.display()))?;
    let (health, health_service) = tonic_health::server::health_reporter();
    for service in SERVED_SERVICES {
        health.set_service_status(service, tonic_health::ServingStatus::Serving).await;
    }
    // Both reflection versions: grpcurl and grpc-java speak v1, grpcio-reflection (Python) and
    // older grpcurl only v1alpha. The health service is described too, so clients find it.
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(api::DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service (v1)")?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(api::DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .context("building the reflection service (v1alpha)")?;
    let services = Services { engine: engine.clone(), shutdown: shutdown.clone(), metrics: metrics.clone() };
    // One replayer (and its snapshots) for both services.
    let replay_services = ReplayServices::new(engine.clone(), checkpoints.clone(), shutdown.clone());
    // Outermost first: refusals are counted, auth refusals included.
    let router = builder
        .layer(RefusalLayer(metrics.clone()))
        .layer(AuthLayer(auth))
        // Innermost: rewrites tonic's OUT_OF_RANGE for an over-size request before it is counted.
        .layer(crate::transport_limit::TransportLimitLayer)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(api::ingest_server::IngestServer::new(services.clone()))
        .add_service(api::wakes_server::WakesServer::new(services.clone()))
        .add_service(api::sends_server::SendsServer::new(services.clone()))
        .add_service(api::subscriptions_server::SubscriptionsServer::new(services))
        .add_service(api::memory_server::MemoryServer::new(MemoryService::new(engine.clone())))
        .add_service(api::replay_server::ReplayServer::new(replay_services.clone()))
        .add_service(api::analytics_server::AnalyticsServer::new(replay_services));
    // TCP_NODELAY: without it small responses (a held notice) wait ~40 ms on Nagle's algorithm.
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let stop = shutdown.clone();
    let draining = {
        let stop = stop.clone();
        async move {
            stop.cancelled().await;
            report_draining(&health).await;
        }
    };
    let serve = tokio::spawn(async move {
        // Health says NOT_SERVING before the server stops accepting, so watchers hear it first.
        let graceful = router.serve_with_incoming_shutdown(incoming, draining);
        // serve_with_shutdown waits for every connection without a deadline; bound it.
        tokio::select! {
            result = graceful => result.context("gRPC server")?,
            _ = async { stop.cancelled().await; tokio::time::sleep(SHUTDOWN_GRACE).await } => {
                tracing::warn!("connections still open after the grace period; closing them");
            }
        }
        Ok(())
    });
    let (metrics_addr, serve_metrics) = match metrics_listener {
        Some(listener) => {
            let addr = listener.local_addr()?;
            let task = tokio::spawn(crate::metrics::serve(
                listener,
                metrics.clone(),
                engine.clone(),
                checkpoints.clone(),
                shutdown.clone(),
            ));
            tracing::info!(%addr, "serving metrics");
            (Some(addr), Some(task))
        }
        None => (None, None),
    };
    tracing::info!(%local_addr, backend = backend_name, tls = config.tls_files().is_some(), "serving");
    Ok(RunningServer {
        local_addr,
        metrics_addr,
        engine,
        metrics,
        checkpoints,
        shutdown,
        serve,
        serve_metrics,
        runner: Some(runner),
        recovery: Some(recovery),
        scheduler,
        serving_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    const WAIT: Duration = Duration::from_secs(30);

    /// A runner that can no longer checkpoint ends the server instead of leaving it up and
    /// useless: health goes NOT_SERVING, and `run_until` returns the cause (the process exits
    /// non-zero), without any signal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_runner_takes_the_server_down_with_the_cause() {
        let dir = tempfile::tempdir().unwrap();
        let mut config =
            Config { data: dir.path().to_path_buf(), listen: "127.0.0.1:0".parse().unwrap(), ..Config::default() };
        config.runner.checkpoint_every_events = 1;
        let server = start(config).await.unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        let mut watch = health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
        let first = watch.message().await.unwrap().unwrap();
        assert_eq!(first.status(), ServingStatus::Serving);

        server.checkpoints.inject_write_failure();
        let engine = server.engine.clone();
        let running = tokio::spawn(server.run_until(std::future::pending()));
        let agent = events::AgentRegistered { agent_id: "ada".into(), ..Default::default() };
        // Its verdict may or may not arrive before the runner fails; the failure is what matters.
        let _ = engine.sync_agents(&[agent]).await;

        let ended = tokio::time::timeout(WAIT, running).await.expect("the server stops on its own").unwrap();
        let error = ended.expect_err("a failed runner is an error exit");
        let text = format!("{error:#}");
        assert!(
            text.contains("projection runner failed") && text.contains("injected checkpoint write failure"),
            "{text}"
        );
        let mut statuses = Vec::new();
        while let Ok(Some(message)) = watch.message().await {
            statuses.push(message.status());
        }
        assert!(statuses.contains(&ServingStatus::NotServing), "health watchers heard NOT_SERVING: {statuses:?}");
    }
}
