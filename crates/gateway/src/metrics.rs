//! Prometheus metrics of one engine instance, served on their own HTTP listener
//! (`metrics_listen`; off when unset) in the OpenMetrics text format at `GET /metrics`.
//!
//! What is measured, and where:
//! * `anima_log_append_seconds{call}` — how long each append to the log took (histogram), from
//!   the engine's [`AppendObserver`] hook around its log, so every append is timed in one place.
//! * `anima_log_last_seq`, `anima_fold_applied_seq`, `anima_fold_lag_events` — the log's newest
//!   sequence, the sequence the fold has applied, and the difference, read at scrape time.
//! * `anima_state_estimate_bytes`, `anima_state_budget_bytes` — the fold state's own estimate of
//!   the memory it takes (as of the runner's last look: at start and after each landed
//!   checkpoint) and the share of `memory_budget_mib` it is held to now: the share is lowered
//!   while the process's RSS is over nine tenths of the budget (`anima_engine::budget`). Set
//!   beside the process's RSS, they tell what of it the fold holds.
//! * `anima_data_dir_bytes` — the data dir's files on disk (the embedded log's sled files and
//!   the checkpoint store's), read at scrape time: sled's file grows far past what it holds under
//!   heavy traffic, and `anima-wake compact` gives the disk back offline (README, "What a data
//!   dir holds").
//! * `anima_checkpoint_store_open_seconds`, `anima_checkpoint_journal_read_at_open_bytes`,
//!   `anima_restore_seconds` — the steps of this instance's start that depend on the history:
//!   the checkpoint store's open, which reads and replays its whole journal, the journal it
//!   read, and the restore of the fold's state from the checkpoint after it. A long journal at
//!   the open means the process did not stop cleanly before (a stop replaces it).
//! * `anima_cold_reads_total`, `anima_cold_read_entries_total`, `anima_cold_read_seconds_total`
//!   — the fold's reads of state it had let go of (to stay under its budget) back from the
//!   checkpoint store: how many, the entries they gave back, and the time they took on the
//!   fold's thread, under the state lock.
//! * `anima_grpc_refused_total{rpc, code}` — every gRPC call answered with a status other than OK
//!   (auth refusals, invalid input, fold refusals, unavailable log), counted by [`RefusalLayer`]
//!   from the status the response starts with; plus the in-band errors of `AppendStream` items.
//! * `grpc_server_handled_total{grpc_service, grpc_method, grpc_code}` and
//!   `grpc_server_handling_seconds{grpc_service, grpc_method}` — every call, by the usual names of
//!   gRPC server metrics, from the same layer: the code and the time to the response's start (the
//!   whole call for unary RPCs; for streams, until the stream started — a stream that fails later
//!   carries its status in trailers and is counted as started OK).
//! * `anima_build_info{version}` — always 1; the running version as a label.
//! * `anima_wakes_claimed_total`, `anima_wakes_settled_without_turn_total`,
//!   `anima_wakes_started_total`, `anima_wakes_finished_total{outcome}` — wakes through the API.
//! * `anima_sends_total{verdict}` — send requests the fold allowed or held.
//!
//! Every label has a bounded set of values: `rpc` is a method of a service this server knows
//! (anything else is `unknown`), `code` a gRPC code, `outcome` and `verdict` fixed names. The
//! metrics carry no content, no agent ids and no tokens, which is why the listener needs none.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use anima_engine::checkpoint::CheckpointStore;
use anima_engine::command::ClaimOutcome;
use anima_engine::metrics::{AppendCall, AppendObserver};
use anima_engine::Engine;
use anima_projections::proto as events;
use anima_projections::verdict::SendVerdict;
use anyhow::Context as _;
use futures::future::BoxFuture;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Metric, Registry};
use tokio_util::sync::CancellationToken;
use tonic::Code;

/// The content type of the OpenMetrics text format `prometheus-client` writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long a scrape waits for the log's last sequence before leaving that gauge stale.
const LAST_SEQ_WAIT: Duration = Duration::from_secs(2);

/// Append latency buckets: 100 µs doubling to ~1.6 s (15 buckets), covering a sled group
/// commit on a fast disk up to a JetStream publish that waits on a slow quorum.
const APPEND_BUCKET_FIRST_SECONDS: f64 = 0.000_1;
const APPEND_BUCKETS: u16 = 15;

/// Methods that are not in the descriptor set but are served: health and reflection.
const INFRASTRUCTURE_RPCS: [&str; 3] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AppendLabels {
    call: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusedLabels {
    rpc: String,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandledLabels {
    grpc_service: String,
    grpc_method: String,
    grpc_code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabels {
    grpc_service: String,
    grpc_method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VerdictLabels {
    verdict: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// The registry and the handles recording into it. Recording is a few atomic operations; the
/// registry is only read by a scrape.
pub struct Metrics {
    registry: Registry,
    append_seconds: HistogramFamily<AppendLabels>,
    log_last_seq: Gauge,
    fold_applied_seq: Gauge,
    fold_lag_events: Gauge,
    state_estimate_bytes: Gauge,
    state_budget_bytes: Gauge,
    data_dir_bytes: Gauge,
    store_open_seconds: Gauge<f64, AtomicU64>,
    journal_read_at_open_bytes: Gauge,
    restore_seconds: Gauge<f64, AtomicU64>,
    cold_reads: Counter,
    cold_read_entries: Counter,
    cold_read_seconds: Counter<f64, AtomicU64>,
    /// Held while the cold-read counters are brought up to the engine's totals, so two scrapes
    /// at once do not both add the same difference.
    cold_reads_sync: Mutex<()>,
    refused: Family<RefusedLabels, Counter>,
    handled: Family<HandledLabels, Counter>,
    handling_seconds: HistogramFamily<MethodLabels>,
    wakes_claimed: Counter,
    wakes_settled_without_turn: Counter,
    wakes_started: Counter,
    wakes_finished: Family<OutcomeLabels, Counter>,
    sends: Family<VerdictLabels, Counter>,
    /// The `/package.Service/Method` paths this server serves: the only values of `rpc`.
    known_rpcs: BTreeSet<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

fn append_histogram() -> Histogram {
    Histogram::new(exponential_buckets(APPEND_BUCKET_FIRST_SECONDS, 2.0, APPEND_BUCKETS))
}

/// A family of histograms with the append buckets, one per label set.
fn histograms<L: Clone + std::hash::Hash + Eq>() -> HistogramFamily<L> {
    HistogramFamily::new_with_constructor(append_histogram as fn() -> _)
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// Registers `metric` under `name` with `help` and hands it back to be kept: the registry and
/// the handle share the same atomics.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let r = &mut registry;
        let build_info: Family<BuildLabels, Gauge> =
            registered(r, "anima_build_info", "The running anima-wake version (always 1)", Family::default());
        build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        let metrics = Metrics {
            append_seconds: registered(
                r,
                "anima_log_append_seconds",
                "Time one append call to the log took, until stored (or refused)",
                histograms(),
            ),
            log_last_seq: registered(
                r,
                "anima_log_last_seq",
                "The log's newest sequence, read at scrape time",
                Gauge::default(),
            ),
            fold_applied_seq: registered(
                r,
                "anima_fold_applied_seq",
                "The newest sequence the fold has applied",
                Gauge::default(),
            ),
            fold_lag_events: registered(
                r,
                "anima_fold_lag_events",
                "Events stored in the log that the fold has not applied yet",
                Gauge::default(),
            ),
            state_estimate_bytes: registered(
                r,
                "anima_state_estimate_bytes",
                "The fold state's own estimate of its memory, at start and after each landed checkpoint",
                Gauge::default(),
            ),
            state_budget_bytes: registered(
                r,
                "anima_state_budget_bytes",
                "The memory the fold's state is held to now (its share of memory_budget_mib, lowered while the process is over nine tenths of it)",
                Gauge::default(),
            ),
            data_dir_bytes: registered(
                r,
                "anima_data_dir_bytes",
                "The data dir's files on disk (the checkpoint store, and the embedded log when it is the backend), read at scrape time",
                Gauge::default(),
            ),
            store_open_seconds: registered(
                r,
                "anima_checkpoint_store_open_seconds",
                "How long the checkpoint store took to open at this instance's start (it reads and replays its whole journal)",
                Gauge::default(),
            ),
            journal_read_at_open_bytes: registered(
                r,
                "anima_checkpoint_journal_read_at_open_bytes",
                "The checkpoint store's journal that open read (a long one is left by a process that did not stop cleanly)",
                Gauge::default(),
            ),
            restore_seconds: registered(
                r,
                "anima_restore_seconds",
                "How long the restore of the fold's state from the checkpoint took at this instance's start",
                Gauge::default(),
            ),
            cold_reads: registered(
                r,
                "anima_cold_reads",
                "Reads the fold made of state it had let go of to stay under its budget, back from the checkpoint store (a point read or a scan each)",
                Counter::default(),
            ),
            cold_read_entries: registered(
                r,
                "anima_cold_read_entries",
                "State entries those reads gave back",
                Counter::default(),
            ),
            cold_read_seconds: registered(
                r,
                "anima_cold_read_seconds",
                "Time those reads took, on the fold's thread under the state lock",
                Counter::default(),
            ),
            cold_reads_sync: Mutex::new(()),
            refused: registered(
                r,
                "anima_grpc_refused",
                "gRPC calls answered with a status other than OK, by method and code",
                Family::default(),
            ),
            handled: registered(
                r,
                "grpc_server_handled",
                "gRPC calls answered, by service, method and code",
                Family::default(),
            ),
            handling_seconds: registered(
                r,
                "grpc_server_handling_seconds",
                "Time from a gRPC call's arrival to the start of its response, by service and method",
                histograms(),
            ),
            wakes_claimed: registered(
                r,
                "anima_wakes_claimed",
                "Wakes handed to a worker by Wakes.Claim",
                Counter::default(),
            ),
            wakes_settled_without_turn: registered(
                r,
                "anima_wakes_settled_without_turn",
                "Queued wakes a claim settled without a turn (already covered)",
                Counter::default(),
            ),
            wakes_started: registered(r, "anima_wakes_started", "Wakes started by Wakes.Start", Counter::default()),
            wakes_finished: registered(
                r,
                "anima_wakes_finished",
                "Wakes finished by Wakes.Finish, by outcome",
                Family::default(),
            ),
            sends: registered(
                r,
                "anima_sends",
                "Send requests decided by the fold, by verdict",
                Family::default(),
            ),
            known_rpcs: known_rpcs(),
            registry,
        };
        // Known label values start at zero, so the first hold or failure is a visible increase.
        for verdict in ["allowed", "held"] {
            let _ = metrics.sends.get_or_create(&VerdictLabels { verdict });
        }
        for outcome in ["completed", "failed", "aborted", "restart_drain"] {
            let _ = metrics.wakes_finished.get_or_create(&OutcomeLabels { outcome });
        }
        metrics
    }

    /// Counts a call answered with `code` (anything but OK).
    pub fn refused(&self, path: &str, code: Code) {
        if code == Code::Ok {
            return;
        }
        let rpc = if self.known_rpcs.contains(path) { path.to_owned() } else { "unknown".to_owned() };
        self.refused.get_or_create(&RefusedLabels { rpc, code: code_name(code) }).inc();
    }

    /// Counts one answered call and how long it took to start its response.
    pub fn handled(&self, path: &str, code: Code, elapsed: Duration) {
        let (grpc_service, grpc_method) =
            match (self.known_rpcs.contains(path), path.trim_start_matches('/').split_once('/')) {
                (true, Some((service, method))) => (service.to_owned(), method.to_owned()),
                _ => ("unknown".to_owned(), "unknown".to_owned()),
            };
        let method = MethodLabels { grpc_service, grpc_method };
        self.handling_seconds.get_or_create(&method).observe(elapsed.as_secs_f64());
        let MethodLabels { grpc_service, grpc_method } = method;
        self.handled.get_or_create(&HandledLabels { grpc_service, grpc_method, grpc_code: grpc_code_name(code) }).inc();
    }

    /// Counts what one `Wakes.Claim` did.
    pub fn wake_claimed(&self, outcome: &ClaimOutcome) {
        if outcome.wake.is_some() {
            self.wakes_claimed.inc();
        }
        self.wakes_settled_without_turn.inc_by(outcome.settled_without_turn.len() as u64);
    }

    pub fn wake_started(&self) {
        self.wakes_started.inc();
    }

    /// Counts a finished wake by its `WakeOutcome`; a restart drain is counted apart from an abort.
    pub fn wake_finished(&self, outcome: i32, restart_drain: bool) {
        let outcome = match events::WakeOutcome::try_from(outcome) {
            Ok(events::WakeOutcome::Aborted) if restart_drain => "restart_drain",
            Ok(events::WakeOutcome::Completed) => "completed",
            Ok(events::WakeOutcome::Failed) => "failed",
            Ok(events::WakeOutcome::Aborted) => "aborted",
            Ok(events::WakeOutcome::Unspecified) | Err(_) => "unspecified",
        };
        self.wakes_finished.get_or_create(&OutcomeLabels { outcome }).inc();
    }

    /// Counts a send the fold decided.
    pub fn send_decided(&self, verdict: &SendVerdict) {
        let verdict = match verdict {
            SendVerdict::Allowed { .. } => "allowed",
            SendVerdict::Held(_) => "held",
            SendVerdict::NotContacted(_) => "not_contacted",
        };
        self.sends.get_or_create(&VerdictLabels { verdict }).inc();
    }

    /// Reads the fold's position, the log's and the data dir's size, then writes the whole
    /// registry.
    pub async fn render(&self, engine: &Engine, data_dir: &CheckpointStore) -> String {
        match data_dir.data_dir_bytes() {
            Ok(bytes) => {
                self.data_dir_bytes.set(gauge_value(bytes));
            }
            Err(error) => tracing::warn!(%error, "metrics: reading the data dir's size"),
        }
        let (open_took, journal_read) = data_dir.opened();
        self.store_open_seconds.set(open_took.as_secs_f64());
        self.journal_read_at_open_bytes.set(gauge_value(journal_read));
        self.restore_seconds.set(engine.projection().restore_took().as_secs_f64());
        let (estimate, budget) = engine.projection().state_memory_bytes();
        self.state_estimate_bytes.set(gauge_value(estimate));
        self.state_budget_bytes.set(gauge_value(budget));
        {
            // The engine counts; the registry's counters are brought up to its totals.
            let _sync = self.cold_reads_sync.lock().unwrap_or_else(|p| p.into_inner());
            let (reads, entries, seconds) = engine.projection().cold_reads();
            self.cold_reads.inc_by(reads.saturating_sub(self.cold_reads.get()));
            self.cold_read_entries.inc_by(entries.saturating_sub(self.cold_read_entries.get()));
            self.cold_read_seconds.inc_by((seconds - self.cold_read_seconds.get()).max(0.0));
        }
        match tokio::time::timeout(LAST_SEQ_WAIT, engine.log().last_seq()).await {
            Ok(Ok(last)) => {
                let applied = engine.projection().applied_seq();
                self.log_last_seq.set(gauge_value(last));
                self.fold_applied_seq.set(gauge_value(applied));
                self.fold_lag_events.set(gauge_value(last.saturating_sub(applied)));
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "metrics: reading the log's last sequence");
                self.fold_applied_seq.set(gauge_value(engine.projection().applied_seq()));
            }
            Err(_) => {
                tracing::warn!(wait = ?LAST_SEQ_WAIT, "metrics: the log's last sequence did not come in time");
                self.fold_applied_seq.set(gauge_value(engine.projection().applied_seq()));
            }
        }
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("writing to a String cannot fail");
        text
    }
}

impl AppendObserver for Metrics {
    fn appended(&self, call: AppendCall, _records: usize, elapsed: Duration, _ok: bool) {
        self.append_seconds.get_or_create(&AppendLabels { call: call.as_str() }).observe(elapsed.as_secs_f64());
    }
}

fn gauge_value(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// The paths of every method in the served descriptor set, plus health and reflection.
fn known_rpcs() -> BTreeSet<String> {
    let mut rpcs: BTreeSet<String> = INFRASTRUCTURE_RPCS.iter().map(|p| (*p).to_owned()).collect();
    match prost_reflect::DescriptorPool::decode(crate::api::DESCRIPTOR_SET) {
        Ok(pool) => {
            for service in pool.services() {
                for method in service.methods() {
                    rpcs.insert(format!("/{}/{}", service.full_name(), method.name()));
                }
            }
        }
        // Built into the binary, so this is a build bug; every rpc label is then `unknown`.
        Err(error) => tracing::error!(%error, "metrics: decoding the API descriptors"),
    }
    rpcs
}

/// The gRPC code as the lower-case name of its enum constant (`permission_denied`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "cancelled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// The gRPC code as the name its specification uses (`PERMISSION_DENIED`), the usual value of
/// the `grpc_code` label.
pub fn grpc_code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    engine: Engine,
    data_dir: CheckpointStore,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let metrics = metrics.clone();
            let (engine, data_dir) = (engine.clone(), data_dir.clone());
            async move { ([(http::header::CONTENT_TYPE, CONTENT_TYPE)], metrics.render(&engine, &data_dir).await) }
        }),
    );
    axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned()).await.context("metrics listener")
}

/// Binds the metrics listener, so a bad address fails start-up rather than a background task.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.with_context(|| format!("metrics_listen: binding {addr}"))
}

/// The tower layer that counts every call answered with a status other than OK. It sits outside
/// the auth layer, so refused tokens are counted too. It reads the status a response starts with
/// (unary errors and streams refused before their first message); a stream that fails later
/// carries its status in trailers and is not counted.
#[derive(Clone)]
pub struct RefusalLayer(pub Arc<Metrics>);

impl<S> tower::Layer<S> for RefusalLayer {
    type Service = RefusalService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        RefusalService { inner, metrics: self.0.clone() }
    }
}

#[derive(Clone)]
pub struct RefusalService<S> {
    inner: S,
    metrics: Arc<Metrics>,
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for RefusalService<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let path = request.uri().path().to_owned();
        let metrics = self.metrics.clone();
        // Take the service that was driven to readiness; leave a clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let started = std::time::Instant::now();
        Box::pin(async move {
            let response = inner.call(request).await?;
            // A status in the headers is a trailers-only answer: an error (or an empty OK).
            let code = response.headers().get("grpc-status").map_or(Code::Ok, |v| Code::from_bytes(v.as_bytes()));
            metrics.refused(&path, code);
            metrics.handled(&path, code, started.elapsed());
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_labels_are_the_served_methods_only() {
        let metrics = Metrics::new();
        metrics.refused("/anima.v1.Sends/Send", Code::PermissionDenied);
        metrics.refused("/anima.v1.Sends/Send", Code::PermissionDenied);
        metrics.refused("/attacker.Chosen/Path", Code::Unimplemented);
        metrics.refused("/anima.v1.Sends/Send", Code::Ok);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).unwrap();
        assert!(
            text.contains(r#"anima_grpc_refused_total{rpc="/anima.v1.Sends/Send",code="permission_denied"} 2"#),
            "{text}"
        );
        assert!(text.contains(r#"anima_grpc_refused_total{rpc="unknown",code="unimplemented"} 1"#), "{text}");
        assert!(!text.contains("attacker"), "{text}");
        assert!(!text.contains(r#"code="ok""#), "{text}");
        assert!(metrics.known_rpcs.contains("/anima.v1.Replay/Read"), "{:?}", metrics.known_rpcs);
    }

    #[test]
    fn every_call_is_counted_by_service_method_and_code_with_its_latency() {
        let metrics = Metrics::new();
        metrics.handled("/anima.v1.Sends/Send", Code::Ok, Duration::from_micros(300));
        metrics.handled("/anima.v1.Sends/Send", Code::Aborted, Duration::from_millis(2));
        metrics.handled("/attacker.Chosen/Path", Code::Unimplemented, Duration::from_micros(10));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).unwrap();
        let send = r#"grpc_service="anima.v1.Sends",grpc_method="Send""#;
        assert!(text.contains(&format!(r#"grpc_server_handled_total{{{send},grpc_code="OK"}} 1"#)), "{text}");
        assert!(text.contains(&format!(r#"grpc_server_handled_total{{{send},grpc_code="ABORTED"}} 1"#)), "{text}");
        assert!(text.contains(&format!(r#"grpc_server_handling_seconds_count{{{send}}} 2"#)), "{text}");
        assert!(text.contains(r#"grpc_service="unknown",grpc_method="unknown",grpc_code="UNIMPLEMENTED""#), "{text}");
        assert!(!text.contains("attacker"), "{text}");
        assert!(text.contains(&format!(r#"anima_build_info{{version="{}"}} 1"#, env!("CARGO_PKG_VERSION"))), "{text}");
    }

    #[test]
    fn append_latency_is_a_histogram_per_call() {
        let metrics = Metrics::new();
        metrics.appended(AppendCall::One, 1, Duration::from_micros(150), true);
        metrics.appended(AppendCall::Batch, 3, Duration::from_millis(3), true);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &metrics.registry).unwrap();
        assert!(text.contains("# TYPE anima_log_append_seconds histogram"), "{text}");
        assert!(text.contains(r#"anima_log_append_seconds_count{call="append"} 1"#), "{text}");
        assert!(text.contains(r#"anima_log_append_seconds_bucket{le="0.0002",call="append"} 1"#), "{text}");
        assert!(text.contains(r#"anima_log_append_seconds_count{call="append_batch"} 1"#), "{text}");
    }
}
