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

/// A running server.
pub struct RunningServer {
    pub local_addr: SocketAddr,
    /// Where `/metrics` is served, when `metrics_listen` is configured.
    pub metrics_addr: Option<SocketAddr>,
    pub engine: Engine,
    pub metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    serve: tokio::task::JoinHandle<anyhow::Result<()>>,
    serve_metrics: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    runner: tokio::task::JoinHandle<Result<(), anima_engine::projection::RunnerError>>,
    recovery: tokio::task::JoinHandle<()>,
    scheduler: Option<tokio::task::JoinHandle<()>>,
}

impl RunningServer {
    /// Stops accepting, waits for in-flight work up to a deadline, checkpoints, and returns.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
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
        self.recovery.await.context("recovery task")?;
        if let Some(scheduler) = self.scheduler {
            scheduler.await.context("memory-pass scheduler task")?;
        }
        self.runner.await.context("runner task")??;
        Ok(())
    }

    /// Waits until the server stops on its own (it does not, unless it fails) or `signal` fires.
    pub async fn run_until(self, signal: impl std::future::Future<Output = ()>) -> anyhow::Result<()> {
        signal.await;
        tracing::info!("shutting down");
        self.shutdown().await
    }
}

/// Starts an engine instance and its gRPC server.
pub async fn start(config: Config) -> anyhow::Result<RunningServer> {
    config.validate()?;
    let auth = Auth::new(&config.tokens)?;
    let backend = match &config.nats {
        Some(url) => Backend::JetStream(JetStreamConfig {
            url: url.clone(),
            stream: config.stream.clone(),
            replicas: config.replicas,
            ..JetStreamConfig::default()
        }),
        None => Backend::Embedded(EmbeddedConfig::default()),
    };
    let mut instance_config = InstanceConfig::new(&config.data, backend);
    instance_config.runner = RunnerConfig {
        checkpoint_every_events: config.runner.checkpoint_every_events,
        checkpoint_interval: config.checkpoint_interval(),
        ..RunnerConfig::default()
    };
    instance_config.engine =
        EngineConfig { verdict_wait: Duration::from_millis(config.runner.verdict_wait_ms), ..EngineConfig::default() };
    let metrics = Arc::new(Metrics::new());
    instance_config.append_observer = Some(metrics.clone());
    instance_config.memory = Some(config.memory_coherence.to_config()?);
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
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        builder = builder.tls_config(tls).context("tls_cert, tls_key: not a usable PEM certificate chain and key")?;
    }
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(crate::metrics::bind(addr).await?),
        None => None,
    };
    let Instance { engine, backend_name, shutdown, runner, recovery, scheduler } =
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
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<api::ingest_server::IngestServer<Services>>().await;
    health.set_serving::<api::wakes_server::WakesServer<Services>>().await;
    health.set_serving::<api::sends_server::SendsServer<Services>>().await;
    health.set_serving::<api::subscriptions_server::SubscriptionsServer<Services>>().await;
    health.set_serving::<api::memory_server::MemoryServer<MemoryService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(api::DESCRIPTOR_SET)
        .build_v1()
        .context("building the reflection service")?;
    let services = Services { engine: engine.clone(), shutdown: shutdown.clone(), metrics: metrics.clone() };
    // One replayer (and its snapshots) for both services.
    let replay_services = ReplayServices::new(engine.clone(), shutdown.clone());
    // Outermost first: refusals are counted, auth refusals included.
    let router = builder
        .layer(RefusalLayer(metrics.clone()))
        .layer(AuthLayer(auth))
        // Innermost: rewrites tonic's OUT_OF_RANGE for an over-size request before it is counted.
        .layer(crate::transport_limit::TransportLimitLayer)
        .add_service(health_service)
        .add_service(reflection)
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
    let serve = tokio::spawn(async move {
        let graceful = router.serve_with_incoming_shutdown(incoming, stop.clone().cancelled_owned());
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
            let task = tokio::spawn(crate::metrics::serve(listener, metrics.clone(), engine.clone(), shutdown.clone()));
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
        shutdown,
        serve,
        serve_metrics,
        runner,
        recovery,
        scheduler,
    })
}
