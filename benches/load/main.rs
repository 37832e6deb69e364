//! `anima-load`: the real `anima-wake serve` under mixed gRPC load for a bounded time.
//!
//! It starts the engine itself on loopback (embedded log, or JetStream: a given `--nats URL` or a
//! `nats-server` it starts), registers a fixed fleet of agents, drives ingest streams, runtime
//! loops, send loops and readers at bounded rates (`workload`), prints one line every 5 s (ops/s,
//! p50/p99 and errors per RPC, fold lag from `/metrics`, the engine's RSS), a summary at the end,
//! and with `--chart FILE` an SVG of the run. The engine is stopped with SIGTERM at the end.

mod chart;
mod engine;
mod nats;
mod stats;
mod workload;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use clap::{Parser, ValueEnum};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::chart::ChartPoint;
use crate::engine::{EngineProcess, FoldProbe, LogBackend, StopSteps};
use crate::stats::{millis, quantile, Recorder, Rpc, Window};
use crate::workload::Fleet;

/// How often `/metrics` and the engine's RSS are sampled.
const SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// How long the load's tasks may take to finish their calls once told to stop.
const DRAIN_WAIT_MAX: Duration = Duration::from_secs(15);
/// Rates above these are refused: they are typing errors, not loads this machine can offer.
const RATE_PER_SECOND_MAX: f64 = 1_000_000.0;
const DURATION_SECONDS_MAX: u64 = 24 * 3600;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Embedded,
    Jetstream,
}

/// Mixed gRPC load against a real `anima-wake serve` on loopback, with a report every few
/// seconds, a summary and an optional chart.
#[derive(Debug, Parser)]
#[command(name = "anima-load")]
struct Args {
    /// The `anima-wake` binary (default: the one next to this executable; build it with
    /// `cargo build --release -p anima-gateway --bin anima-wake`).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// The engine's log. `jetstream` starts its own `nats-server -js` unless --nats is given.
    #[arg(long, value_enum, default_value = "embedded")]
    backend: Backend,
    /// Run the engine on JetStream at this URL (implies --backend jetstream).
    #[arg(long)]
    nats: Option<String>,
    /// How long the load runs.
    #[arg(long, default_value_t = 60)]
    duration_seconds: u64,
    /// Agents registered (one runtime loop each).
    #[arg(long, default_value_t = 16)]
    agents: usize,
    /// Slack DMs, Slack channels, p2p and group chats, dealt out to the agents in turn
    /// (at least 4 per agent).
    #[arg(long, default_value_t = 400)]
    surfaces: usize,
    /// Observations appended per second, over all ingest streams.
    #[arg(long, default_value_t = 6000.0)]
    ingest_per_second: f64,
    /// `Ingest.AppendStream` calls open at once.
    #[arg(long, default_value_t = 4)]
    ingest_streams: usize,
    /// Wakes claimed per second at most, over all runtime loops (one per agent): each is Claim,
    /// Start, Send (+ resend) + Confirm or Respond + ConfirmResponse, Finish.
    #[arg(long, default_value_t = 400.0)]
    wakes_per_second: f64,
    /// Posts outside wakes per second, over all send loops: Send (+ resend when held) + Confirm.
    #[arg(long, default_value_t = 1500.0)]
    sends_per_second: f64,
    /// Send loops (each one call at a time).
    #[arg(long, default_value_t = 8)]
    send_loops: usize,
    /// Seconds between `Analytics.Counts` calls (0: none).
    #[arg(long, default_value_t = 10.0)]
    counts_every_seconds: f64,
    /// Seconds between `Replay.StateAt` calls (0: none).
    #[arg(long, default_value_t = 5.0)]
    state_at_every_seconds: f64,
    /// Seconds between walks of one agent's `Subscriptions.List` pages (0: none).
    #[arg(long, default_value_t = 10.0)]
    list_every_seconds: f64,
    /// HTTP/2 connections the clients share.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Seconds between report lines.
    #[arg(long, default_value_t = 5)]
    report_every_seconds: u64,
    /// Stop the run early when the engine's RSS passes this (MiB): the machine is shared, and an
    /// engine whose memory grows with history must not take it down.
    #[arg(long, default_value_t = 6144)]
    rss_limit_mib: u64,
    /// A TOML file whose contents are added to the engine's config (e.g. a `[runner]` table with
    /// `memory_budget_mib`), to run the load against other settings.
    #[arg(long)]
    engine_config: Option<std::path::PathBuf>,
    /// Write a self-contained SVG chart of the run (ops/s, Send p99, fold lag, RSS) here.
    #[arg(long)]
    chart: Option<PathBuf>,
    /// Print every call that took this long or longer (milliseconds; 0: none) on stderr, with
    /// the UTC time it was answered, to match with the engine's and nats-server's logs.
    #[arg(long, default_value_t = 100)]
    slow_call_ms: u64,
    /// Do not write the machine's page cache out (`sync`) before the load starts. By default the
    /// tool does: the kernel writes a file's data back once it is 30 s old, and while it writes
    /// back what another process left (a build just before the run writes hundreds of MiB) the
    /// engine's log syncs wait behind it. Measured: 400 MiB written just before a run stalled a
    /// group commit 365 ms, 31 s in; the same with a `sync` between, the slowest commit 25.2 ms.
    #[arg(long)]
    no_sync_first: bool,
}

impl Args {
    fn check(&self) -> anyhow::Result<()> {
        if self.agents == 0 || self.surfaces < 4 * self.agents {
            bail!("--surfaces must be at least 4 × --agents (every agent gets each kind of surface), and --agents ≥ 1");
        }
        for (name, rate) in [
            ("--ingest-per-second", self.ingest_per_second),
            ("--wakes-per-second", self.wakes_per_second),
            ("--sends-per-second", self.sends_per_second),
        ] {
            if !(0.0..=RATE_PER_SECOND_MAX).contains(&rate) {
                bail!("{name}: expected 0..={RATE_PER_SECOND_MAX}, got {rate}");
            }
        }
        if self.duration_seconds == 0 || self.duration_seconds > DURATION_SECONDS_MAX {
            bail!("--duration-seconds: expected 1..={DURATION_SECONDS_MAX}, got {}", self.duration_seconds);
        }
        if self.ingest_streams == 0 || self.send_loops == 0 || self.connections == 0 || self.report_every_seconds == 0 {
            bail!("--ingest-streams, --send-loops, --connections and --report-every-seconds must be at least 1");
        }
        if !(self.counts_every_seconds >= 0.0 && self.state_at_every_seconds >= 0.0 && self.list_every_seconds >= 0.0) {
            bail!("--counts-every-seconds, --state-at-every-seconds and --list-every-seconds must be ≥ 0");
        }
        Ok(())
    }

    fn backend(&self) -> Backend {
        if self.nats.is_some() {
            Backend::Jetstream
        } else {
            self.backend
        }
    }
}

/// A probe of the engine at one moment of the run.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at_seconds: f64,
    fold: Option<FoldProbe>,
    rss_kib: Option<u64>,
    /// CPU seconds used so far by the engine and by this tool.
    engine_cpu_seconds: Option<f64>,
    load_cpu_seconds: Option<f64>,
    /// The `nats-server` the tool started, if it did: its RSS and CPU seconds so far. Its heap
    /// holds the stream's duplicate-window index (every msg id of the last 10 minutes).
    nats_rss_kib: Option<u64>,
    nats_cpu_seconds: Option<f64>,
    /// The machine's page cache not yet on disk (Dirty + Writeback), KiB.
    unwritten_kib: Option<u64>,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("anima-load: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` reads well whether or not RUST_BACKTRACE is set.
            eprintln!("anima-load: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    args.check()?;
    let binary = match &args.binary {
        Some(path) => path.clone(),
        None => engine::default_binary()?,
    };
    engine::check_binary(&binary)?;
    let (backend, nats) = match (args.backend(), &args.nats) {
        (Backend::Embedded, _) => (LogBackend::Embedded, None),
        (Backend::Jetstream, Some(url)) => (LogBackend::JetStream(url.clone()), None),
        (Backend::Jetstream, None) => {
            let server = nats::NatsServer::start().await?;
            (LogBackend::JetStream(server.url()), Some(server))
        }
    };
    let backend_name = match (&backend, &nats) {
        (LogBackend::Embedded, _) => "embedded log (sled)".to_owned(),
        (LogBackend::JetStream(_), Some(_)) => "JetStream (nats-server started by the tool)".to_owned(),
        (LogBackend::JetStream(url), None) => format!("JetStream at {url}"),
    };
    eprintln!("anima-load: starting {} on {backend_name}", binary.display());
    if let LogBackend::JetStream(url) = &backend {
        eprintln!("anima-load: JetStream at {url}");
    }
    let extra_config = match &args.engine_config {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?,
        None => String::new(),
    };
    let mut engine = EngineProcess::start(&binary, backend, nats, &extra_config).await?;
    eprintln!(
        "anima-load: engine pid {} serving gRPC on {}, metrics on {}",
        engine.pid, engine.grpc_addr, engine.metrics_addr
    );
    let outcome = drive(&args, &backend_name, &mut engine).await;
    let stopped = engine.stop().await?;
    eprintln!("anima-load: engine stopped: {}", StopSteps::from(&stopped).describe());
    outcome
}

/// Registers the fleet, runs the load for the configured time, reports and charts it.
async fn drive(args: &Args, backend_name: &str, engine: &mut EngineProcess) -> anyhow::Result<()> {
    let mut channels = Vec::with_capacity(args.connections);
    for _ in 0..args.connections {
        let channel = Endpoint::from_shared(format!("http://{}", engine.grpc_addr))?
            .tcp_nodelay(true)
            .connect()
            .await
            .context("connect to the engine")?;
        channels.push(channel);
    }
    let fleet = Arc::new(Fleet::new(args.agents, args.surfaces));
    workload::register_agents(&fleet, channels[0].clone()).await?;
    write_page_cache_out(!args.no_sync_first).await;

    let stop = CancellationToken::new();
    let slow_call = (args.slow_call_ms > 0).then(|| Duration::from_millis(args.slow_call_ms));
    let recorder = Arc::new(Recorder::new(slow_call));
    let samples = Arc::new(Mutex::new(Vec::<Sample>::new()));
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    spawn_load(args, &fleet, &channels, &stop, &recorder, &mut tasks);
    let sampler = tokio::spawn(sample_engine(
        (engine.pid, engine.nats_pid()),
        engine.metrics_addr,
        started,
        stop.clone(),
        samples.clone(),
    ));
    eprintln!(
        "anima-load: {} s of load: {} agents, {} surfaces, ingest {}/s over {} streams, wakes ≤ {}/s, \
         sends {}/s over {} loops, Counts every {} s, StateAt every {} s, List every {} s",
        args.duration_seconds,
        args.agents,
        args.surfaces,
        args.ingest_per_second,
        args.ingest_streams,
        args.wakes_per_second,
        args.sends_per_second,
        args.send_loops,
        args.counts_every_seconds,
        args.state_at_every_seconds,
        args.list_every_seconds
    );

    let mut report = Report::default();
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + Duration::from_secs(1), Duration::from_secs(1));
    let deadline = Duration::from_secs(args.duration_seconds);
    let mut failure = None;
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = &mut ctrl_c => {
                eprintln!("anima-load: interrupted; stopping the load");
                break;
            }
        }
        let at = started.elapsed().as_secs_f64();
        report.second(at, recorder.take(), &samples.lock().expect("samples lock"), true);
        if (report.seconds.len() as u64).is_multiple_of(args.report_every_seconds) {
            println!("{}", report.line(&fleet));
        }
        if let Some(status) = engine.exited() {
            failure = Some(anyhow::anyhow!(
                "the engine exited during the run ({status}); its stderr:\n{}",
                engine.stderr_tail()
            ));
            break;
        }
        if let Some(rss) = report.chart.last().map(|p| p.rss_mib).filter(|&rss| rss > args.rss_limit_mib as f64) {
            eprintln!(
                "anima-load: the engine's RSS is {rss:.0} MiB, over --rss-limit-mib {}; ending the run early",
                args.rss_limit_mib
            );
            break;
        }
        if started.elapsed() >= deadline {
            break;
        }
    }
    let load_seconds = started.elapsed().as_secs_f64();
    stop.cancel();
    let drained = tokio::time::timeout(DRAIN_WAIT_MAX, async {
        while let Some(joined) = tasks.join_next().await {
            if let Err(e) = joined {
                eprintln!("anima-load: a load task failed: {e}");
            }
        }
    })
    .await;
    if drained.is_err() {
        eprintln!("anima-load: load tasks still busy after {DRAIN_WAIT_MAX:?}; abandoning their calls");
        tasks.abort_all();
    }
    let _ = sampler.await;
    // Calls answered while draining count in the totals, not as a second of the chart.
    report.second(load_seconds, recorder.take(), &samples.lock().expect("samples lock"), false);
    drop(channels);
    if let Some(failure) = failure {
        return Err(failure);
    }

    let samples = samples.lock().expect("samples lock").clone();
    let summary = report.summary(load_seconds, &samples, &fleet);
    println!("{summary}");
    for ((rpc, code), message) in recorder.first_messages() {
        println!("first {} {code}: {message}", rpc.name());
    }
    if let Some(path) = &args.chart {
        let title = format!("anima-load: {backend_name}, {load_seconds:.0} s");
        let subtitle = format!(
            "{} agents, {} surfaces; ingest {}/s, wakes ≤ {}/s, sends {}/s; {}",
            args.agents,
            args.surfaces,
            args.ingest_per_second,
            args.wakes_per_second,
            args.sends_per_second,
            report.headline(load_seconds, &samples)
        );
        std::fs::write(path, chart::svg(&title, &subtitle, &report.chart))
            .with_context(|| format!("write the chart to {}", path.display()))?;
        eprintln!("anima-load: chart written to {}", path.display());
    }
    Ok(())
}

fn spawn_load(
    args: &Args,
    fleet: &Arc<Fleet>,
    channels: &[Channel],
    stop: &CancellationToken,
    recorder: &Arc<Recorder>,
    tasks: &mut JoinSet<()>,
) {
    let mut next_channel = 0usize;
    let mut channel = || {
        next_channel += 1;
        channels[next_channel % channels.len()].clone()
    };
    if args.ingest_per_second > 0.0 {
        let per_stream = args.ingest_per_second / args.ingest_streams as f64;
        for _ in 0..args.ingest_streams {
            tasks.spawn(workload::ingest_stream(fleet.clone(), channel(), per_stream, stop.clone(), recorder.clone()));
        }
    }
    if args.wakes_per_second > 0.0 {
        let per_agent = args.wakes_per_second / fleet.agent_count() as f64;
        for agent in 0..fleet.agent_count() {
            tasks.spawn(workload::runtime_loop(
                fleet.clone(),
                agent,
                channel(),
                per_agent,
                stop.clone(),
                recorder.clone(),
            ));
        }
    }
    if args.sends_per_second > 0.0 {
        let per_loop = args.sends_per_second / args.send_loops as f64;
        for index in 0..args.send_loops {
            tasks.spawn(workload::send_loop(
                fleet.clone(),
                index,
                args.send_loops,
                channel(),
                per_loop,
                stop.clone(),
                recorder.clone(),
            ));
        }
    }
    if args.counts_every_seconds > 0.0 {
        let period = Duration::from_secs_f64(args.counts_every_seconds);
        tasks.spawn(workload::counts_reader(channel(), period, stop.clone(), recorder.clone()));
    }
    if args.state_at_every_seconds > 0.0 {
        let period = Duration::from_secs_f64(args.state_at_every_seconds);
        tasks.spawn(workload::state_at_reader(fleet.clone(), channel(), period, stop.clone(), recorder.clone()));
    }
    if args.list_every_seconds > 0.0 {
        let period = Duration::from_secs_f64(args.list_every_seconds);
        tasks.spawn(workload::list_reader(fleet.clone(), channel(), period, stop.clone(), recorder.clone()));
    }
}

/// Says how much of the machine's page cache is not yet on disk and, when `sync_first`, writes it
/// all out first (see `--no-sync-first`), so that what the run measures is the engine's own disk
/// traffic, not the writeback of files another process wrote just before.
async fn write_page_cache_out(sync_first: bool) {
    let mib =
        |kib: Option<u64>| kib.map_or_else(|| "unknown".to_owned(), |kib| format!("{:.0} MiB", kib as f64 / 1024.0));
    let before = engine::unwritten_kib();
    if !sync_first {
        eprintln!("anima-load: the page cache holds {} not yet on disk; not synced (--no-sync-first)", mib(before));
        return;
    }
    let started = Instant::now();
    // `sync` blocks until the writeback ends: off the runtime's workers. It reports no error;
    // only its task can fail (a panic).
    let synced = tokio::task::spawn_blocking(rustix::fs::sync).await.is_ok();
    eprintln!(
        "anima-load: the page cache held {} not yet on disk; {} in {:.2} s before the load ({} after)",
        mib(before),
        if synced { "written out (sync)" } else { "the sync's task failed" },
        started.elapsed().as_secs_f64(),
        mib(engine::unwritten_kib())
    );
}

/// Probes `/metrics` and the engine's RSS every [`SAMPLE_INTERVAL`] until `stop`.
async fn sample_engine(
    (pid, nats_pid): (u32, Option<u32>),
    metrics_addr: std::net::SocketAddr,
    started: Instant,
    stop: CancellationToken,
    samples: Arc<Mutex<Vec<Sample>>>,
) {
    let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let fold = engine::scrape_fold(metrics_addr).await.ok();
        let sample = Sample {
            at_seconds: started.elapsed().as_secs_f64(),
            fold,
            rss_kib: engine::rss_kib(pid),
            engine_cpu_seconds: engine::cpu_seconds(&pid.to_string()),
            load_cpu_seconds: engine::cpu_seconds("self"),
            nats_rss_kib: nats_pid.and_then(engine::rss_kib),
            nats_cpu_seconds: nats_pid.and_then(|pid| engine::cpu_seconds(&pid.to_string())),
            unwritten_kib: engine::unwritten_kib(),
        };
        samples.lock().expect("samples lock").push(sample);
    }
}

/// What the run has measured so far: per second for the chart, per report line, and in total.
#[derive(Default)]
struct Report {
    seconds: Vec<f64>,
    chart: Vec<ChartPoint>,
    /// Calls since the last report line.
    since_line: Window,
    since_line_started: f64,
    /// Samples already attributed to a second.
    samples_seen: usize,
    /// Every call of the run: the summary's percentiles and maxima are exact (4 bytes a call).
    totals: Window,
    /// Fold lag samples of the current report line.
    line_lags: Vec<u64>,
    /// CPU seconds (engine, this tool) at the newest sample, at the start of the current report
    /// line, and at the first sample.
    cpu_now: Option<(f64, f64)>,
    cpu_line_start: Option<(f64, f64)>,
    cpu_first: Option<(f64, f64)>,
    /// The fold state's own estimate of its memory at the newest sample that had one, MiB.
    state_mib: Option<f64>,
    /// The engine's data dir on disk, MiB, as of the newest scrape.
    data_dir_mib: Option<f64>,
}

impl Report {
    /// Takes one second's calls and the samples since the previous second; `charted`: as a
    /// point of the chart (the drain after the run is not).
    fn second(&mut self, at: f64, window: Window, samples: &[Sample], charted: bool) {
        let new_samples = &samples[self.samples_seen.min(samples.len())..];
        self.samples_seen = samples.len();
        let lags: Vec<u64> = new_samples.iter().filter_map(|s| s.fold.map(|f| f.lag_events)).collect();
        let rss =
            new_samples.iter().rev().find_map(|s| s.rss_kib).or_else(|| samples.iter().rev().find_map(|s| s.rss_kib));
        let interval = at - self.seconds.last().copied().unwrap_or(0.0);
        if charted {
            let mut send = window.rpc(Rpc::Send).latencies_us.clone();
            self.chart.push(ChartPoint {
                at_seconds: at,
                ops_per_second: window.ok_calls() as f64 / interval.max(0.001),
                send_p99_ms: f64::from(quantile(&mut send, 0.99)) / 1000.0,
                fold_lag_events: lags.iter().copied().max().unwrap_or(0) as f64,
                rss_mib: rss.unwrap_or(0) as f64 / 1024.0,
            });
            self.seconds.push(at);
        }
        if let Some(fold) = new_samples.iter().rev().find_map(|s| s.fold) {
            self.state_mib = Some(fold.state_estimate_bytes as f64 / (1024.0 * 1024.0));
            self.data_dir_mib = Some(fold.data_dir_bytes as f64 / (1024.0 * 1024.0));
        }
        self.totals.merge(&window);
        self.since_line.merge(&window);
        self.line_lags.extend(lags);
        if let Some(cpu) = samples.iter().rev().find_map(|s| s.engine_cpu_seconds.zip(s.load_cpu_seconds)) {
            self.cpu_first.get_or_insert(cpu);
            self.cpu_line_start.get_or_insert(cpu);
            self.cpu_now = Some(cpu);
        }
    }

    /// One report line for the calls since the previous one; starts the next.
    fn line(&mut self, fleet: &Fleet) -> String {
        let now = self.seconds.last().copied().unwrap_or(0.0);
        let interval = (now - self.since_line_started).max(0.001);
        let window = std::mem::take(&mut self.since_line);
        let mut lags = std::mem::take(&mut self.line_lags);
        self.since_line_started = now;
        let mut line = format!("[{now:>5.0} s] {:>6.0} ops/s |", window.ok_calls() as f64 / interval);
        let cpu = cpu_percent(self.cpu_line_start, self.cpu_now, interval);
        self.cpu_line_start = self.cpu_now;
        for rpc in Rpc::ALL {
            let calls = window.rpc(rpc);
            if calls.latencies_us.is_empty() && calls.errors.is_empty() {
                continue;
            }
            let mut latencies = calls.latencies_us.clone();
            let p50 = quantile(&mut latencies, 0.5);
            let p99 = quantile(&mut latencies, 0.99);
            line.push_str(&format!(
                " {} {}/s {}/{} ms",
                rpc.name(),
                rate(calls.latencies_us.len() as f64 / interval),
                millis(p50),
                millis(p99)
            ));
            for (code, count) in &calls.errors {
                line.push_str(&format!(" [{code} {count}]"));
            }
            line.push_str(" |");
        }
        let lag_p99 = quantile(&mut lags, 0.99);
        let lag_max = lags.iter().copied().max().unwrap_or(0);
        let rss = self.chart.last().map_or(0.0, |p| p.rss_mib);
        let state = self.state_mib.map_or_else(String::new, |mib| format!(" (fold state est. {mib:.0})"));
        let data = self.data_dir_mib.map_or_else(String::new, |mib| format!(" | data dir {mib:.0} MiB"));
        line.push_str(&format!(
            " fold lag p99 {lag_p99} max {lag_max} ev | rss {rss:.0} MiB{state}{data} | cpu {cpu} | held {}",
            fleet.sends_held.load(std::sync::atomic::Ordering::Relaxed)
        ));
        line
    }

    /// The few figures the chart's subtitle shows.
    fn headline(&self, load_seconds: f64, samples: &[Sample]) -> String {
        let total = self.totals.ok_calls();
        let mut send = self.totals.rpc(Rpc::Send).latencies_us.clone();
        let mut lags: Vec<u64> = samples.iter().filter_map(|s| s.fold.map(|f| f.lag_events)).collect();
        format!(
            "{:.0} ops/s, Send p99 {} ms, max {} ms, fold lag p99 {} events",
            total as f64 / load_seconds.max(0.001),
            millis(quantile(&mut send, 0.99)),
            millis(send.iter().copied().max().unwrap_or(0)),
            quantile(&mut lags, 0.99)
        )
    }

    fn summary(&self, load_seconds: f64, samples: &[Sample], fleet: &Fleet) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let mut out = String::from("\n== anima-load summary ==\n");
        let total = self.totals.ok_calls();
        let ops = total as f64 / load_seconds.max(0.001);
        out.push_str(&format!("duration {load_seconds:.1} s, {total} calls answered OK: {ops:.0} ops/s\n"));
        out.push_str("  rpc                     ok      ok/s   p50 ms   p99 ms   max ms  errors\n");
        for rpc in Rpc::ALL {
            let calls = self.totals.rpc(rpc);
            let ok = calls.latencies_us.len();
            if ok == 0 && calls.errors.is_empty() {
                continue;
            }
            let mut latencies = calls.latencies_us.clone();
            let p50 = quantile(&mut latencies, 0.5);
            let p99 = quantile(&mut latencies, 0.99);
            let max = latencies.last().copied().unwrap_or(0);
            out.push_str(&format!(
                "  {:<16} {:>9} {:>9} {:>8} {:>8} {:>8} ",
                rpc.name(),
                ok,
                rate(ok as f64 / load_seconds.max(0.001)),
                millis(p50),
                millis(p99),
                millis(max)
            ));
            if calls.errors.is_empty() {
                out.push_str(" none");
            }
            for (code, count) in &calls.errors {
                out.push_str(&format!(" {code} {count}"));
            }
            out.push('\n');
        }
        let mut send = self.totals.rpc(Rpc::Send).latencies_us.clone();
        let send_p50 = quantile(&mut send, 0.5);
        let send_p99 = quantile(&mut send, 0.99);
        let send_max = send.last().copied().unwrap_or(0);
        let over_100ms = send.iter().filter(|&&us| us >= 100_000).count();
        out.push_str(&format!(
            "Send: n {} p50 {} ms, p99 {} ms, max {} ms ({} at or over 100 ms); held at first ask {}, still held \
             when resent {}\n",
            send.len(),
            millis(send_p50),
            millis(send_p99),
            millis(send_max),
            over_100ms,
            fleet.sends_held.load(Relaxed),
            fleet.sends_held_twice.load(Relaxed)
        ));
        out.push_str(&format!("cpu: {}\n", cpu_percent(self.cpu_first, self.cpu_now, load_seconds)));
        out.push_str(&format!(
            "claims: {} got a wake, {} found none; Watch signals received {} ({:.0}/s)\n",
            fleet.claims_won.load(Relaxed),
            fleet.claims_empty.load(Relaxed),
            fleet.watch_signals.load(Relaxed),
            fleet.watch_signals.load(Relaxed) as f64 / load_seconds.max(f64::EPSILON)
        ));
        let folds: Vec<(f64, FoldProbe)> = samples.iter().filter_map(|s| s.fold.map(|f| (s.at_seconds, f))).collect();
        let mut lags: Vec<u64> = folds.iter().map(|(_, f)| f.lag_events).collect();
        let lag_p50 = quantile(&mut lags, 0.5);
        let lag_p99 = quantile(&mut lags, 0.99);
        let lag_max = lags.last().copied().unwrap_or(0);
        let fold_rate = match (folds.first(), folds.last()) {
            (Some((t0, f0)), Some((t1, f1))) if t1 > t0 => {
                (f1.applied_seq.saturating_sub(f0.applied_seq)) as f64 / (t1 - t0)
            }
            _ => 0.0,
        };
        let last_seq = folds.last().map_or(0, |(_, f)| f.last_seq);
        let as_ms = |events: u64| if fold_rate > 0.0 { events as f64 / fold_rate * 1000.0 } else { 0.0 };
        out.push_str(&format!(
            "fold: {} samples every {} ms; lag p50 {lag_p50}, p99 {lag_p99}, max {lag_max} events (≈ {:.1} / {:.1} / {:.1} ms \
             at the run's mean fold rate of {fold_rate:.0} events/s); log at seq {last_seq}\n",
            folds.len(),
            SAMPLE_INTERVAL.as_millis(),
            as_ms(lag_p50),
            as_ms(lag_p99),
            as_ms(lag_max)
        ));
        if let Some((_, last)) = folds.last() {
            // Counted since the engine started; nothing leaves memory before the state first
            // reaches its budget, so the reads fall in the run's later part.
            out.push_str(&format!(
                "fold's reads back from the checkpoint store: {} reads ({:.2} per event folded), {} entries, \
                 {:.1} s on the fold's thread under the state lock ({:.1}% of the run)\n",
                last.cold_reads,
                last.cold_reads as f64 / last.applied_seq.max(1) as f64,
                last.cold_read_entries,
                last.cold_read_seconds,
                last.cold_read_seconds / load_seconds.max(f64::EPSILON) * 100.0
            ));
        }
        let rss: Vec<(f64, u64)> = samples.iter().filter_map(|s| s.rss_kib.map(|r| (s.at_seconds, r))).collect();
        if let (Some(&(_, first)), Some(&(_, last))) = (rss.first(), rss.last()) {
            let max = rss.iter().map(|&(_, r)| r).max().unwrap_or(0);
            let half = load_seconds / 2.0;
            let at_half = rss.iter().find(|&&(t, _)| t >= half).map_or(first, |&(_, r)| r);
            let growth = (last as f64 - at_half as f64) / (at_half as f64).max(1.0) * 100.0;
            out.push_str(&format!(
                "engine RSS: first {:.0} MiB, last {:.0} MiB, max {:.0} MiB; over the last half ({:.0} s → end) {:+.1}%\n",
                first as f64 / 1024.0,
                last as f64 / 1024.0,
                max as f64 / 1024.0,
                half,
                growth
            ));
            if let Some(fold) = samples.iter().rev().find_map(|s| s.fold) {
                out.push_str(&format!(
                    "fold state (its own estimate, what the budget holds down): last {:.0} MiB of its {:.0} MiB budget\n",
                    fold.state_estimate_bytes as f64 / (1024.0 * 1024.0),
                    fold.state_budget_bytes as f64 / (1024.0 * 1024.0)
                ));
            }
            // From the first scrape that saw the data dir (0: the engine had not opened it yet).
            let on_disk: Vec<(f64, u64)> = samples
                .iter()
                .filter_map(|s| Some((s.at_seconds, s.fold?.data_dir_bytes)))
                .filter(|&(_, bytes)| bytes > 0)
                .collect();
            if let (Some(&(t0, first)), Some(&(t1, last))) = (on_disk.first(), on_disk.last()) {
                const MIB: f64 = 1024.0 * 1024.0;
                out.push_str(&format!(
                    "data dir (both stores' files, anima_data_dir_bytes): first {:.0} MiB, last {:.0} MiB, \
                     {:.1} MiB/s\n",
                    first as f64 / MIB,
                    last as f64 / MIB,
                    (last as f64 - first as f64) / MIB / (t1 - t0).max(0.001)
                ));
            }
            let nats: Vec<(f64, u64, f64)> =
                samples.iter().filter_map(|s| Some((s.at_seconds, s.nats_rss_kib?, s.nats_cpu_seconds?))).collect();
            if let (Some(&(t0, first, cpu0)), Some(&(t1, last, cpu1))) = (nats.first(), nats.last()) {
                out.push_str(&format!(
                    "nats-server (started by the tool): RSS first {:.0} MiB, last {:.0} MiB, max {:.0} MiB; \
                     CPU {:.0}% of a core\n",
                    first as f64 / 1024.0,
                    last as f64 / 1024.0,
                    nats.iter().map(|&(_, r, _)| r).max().unwrap_or(0) as f64 / 1024.0,
                    (cpu1 - cpu0) / (t1 - t0).max(0.001) * 100.0
                ));
            }
            // The whole machine's, not only the engine's: another process's writeback slows the
            // engine's syncs as much as the engine's own (see `--no-sync-first`).
            if let Some((at, kib)) =
                samples.iter().filter_map(|s| Some((s.at_seconds, s.unwritten_kib?))).max_by_key(|&(_, kib)| kib)
            {
                out.push_str(&format!(
                    "machine's page cache not yet on disk (Dirty + Writeback): max {:.0} MiB, {at:.0} s in\n",
                    kib as f64 / 1024.0
                ));
            }
            out.push_str(&format!(
                "targets (issue 9 item 6): ≥ 10,000 ops/s: {}; Send p99 ≤ 10 ms: {}; slowest Send ≤ 25 ms: {}; \
                 fold lag p99 ≤ 50 ms (estimated): {}; RSS growth over the last half ≤ 5%: {}\n",
                verdict(ops >= 10_000.0),
                verdict(send_p99 <= 10_000),
                verdict(send_max <= 25_000),
                verdict(as_ms(lag_p99) <= 50.0),
                verdict(growth <= 5.0)
            ));
        }
        out
    }
}

/// CPU used between two (engine, tool) readings over `seconds`, as percent of one core.
fn cpu_percent(from: Option<(f64, f64)>, to: Option<(f64, f64)>, seconds: f64) -> String {
    match (from, to) {
        (Some((engine_from, load_from)), Some((engine_to, load_to))) => format!(
            "engine {:.0}% load tool {:.0}% of a core",
            (engine_to - engine_from) / seconds.max(0.001) * 100.0,
            (load_to - load_from) / seconds.max(0.001) * 100.0
        ),
        _ => "unknown".into(),
    }
}

/// A rate with a precision that suits its size.
fn rate(per_second: f64) -> String {
    if per_second < 10.0 {
        format!("{per_second:.1}")
    } else {
        format!("{per_second:.0}")
    }
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}
