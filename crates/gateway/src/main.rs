//! `anima-wake`: the engine's binary.
//!
//! * `anima-wake serve` — run an engine instance: embedded log under `./data` and gRPC on
//!   `127.0.0.1:50051` with no flags; `--nats URL` for JetStream; `--tls-cert`/`--tls-key` for
//!   gRPC over TLS; `--metrics-listen ADDR` for Prometheus metrics at `http://ADDR/metrics`.
//! * `anima-wake replay ...` — read the log for incident debugging (timeline, state, explain,
//!   export, verify), from a data dir, a JetStream stream, or a running server.
//! * `anima-wake digest DIR` — the memory digest runtimes report before and after a memory pass.

use std::net::SocketAddr;
use std::path::PathBuf;

use anima_gateway::config::Config;
use anyhow::Context as _;
use clap::{Parser, Subcommand};

/// The engine's allocator. Under sustained load the system allocator kept freed memory spread
/// over its per-thread arenas, so RSS grew well past what the engine held (see the Memory
/// budget section of ARCHITECTURE.md for the measurement); mimalloc returns freed pages.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "anima-wake", version, about = "Event-sourced wake delivery engine for AI agents")]
struct Cli {
    /// Log lines as human-readable text, or one JSON object per line for log collectors.
    #[arg(long, env = "ANIMA_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Structured logs on stderr. The filter is `ANIMA_LOG` or else `RUST_LOG` (tracing's
/// `EnvFilter` syntax, e.g. `info,anima_engine=debug`), `info` when neither is set; a filter that
/// does not parse is an error rather than a silent `info`. Colour only on a terminal.
fn init_logging(format: LogFormat) -> anyhow::Result<()> {
    use std::io::IsTerminal;
    let (variable, directives) = match (std::env::var("ANIMA_LOG"), std::env::var("RUST_LOG")) {
        (Ok(value), _) => ("ANIMA_LOG", value),
        (Err(_), Ok(value)) => ("RUST_LOG", value),
        (Err(_), Err(_)) => ("default", "info".to_owned()),
    };
    let filter = tracing_subscriber::EnvFilter::builder().parse(&directives).map_err(|e| {
        let shown: String = directives.chars().take(64).collect();
        anyhow::anyhow!("{variable}: not a log filter ({e}): {shown:?}; e.g. info or info,anima_engine=debug")
    })?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_ansi(false).init(),
    }
    Ok(())
}

#[derive(Subcommand)]
enum Command {
    /// Run an engine instance and its gRPC API.
    Serve(ServeArgs),
    /// Read the log for incident debugging.
    Replay(anima_gateway::replay_command::ReplayArgs),
    /// Print the memory digest of an agent directory (MEMORY.md and notes/).
    Digest {
        /// The agent's directory.
        dir: PathBuf,
    },
    /// Print what a data dir takes on disk against what it holds: entries and bytes per tree and
    /// per checkpoint table. The engine must be stopped (sled locks the directory).
    StoreStats {
        /// Data directory. Default ./data.
        #[arg(long, env = "ANIMA_DATA", default_value = "data")]
        data: PathBuf,
    },
    /// Copy a stopped engine's data dir into a new, compact one (every tree, checked against the
    /// source), to give back the disk sled's file keeps. The source is left as it was; start the
    /// engine on the copy (`--data NEW`), then remove the old dir.
    Compact {
        /// Data directory to copy. Default ./data.
        #[arg(long, env = "ANIMA_DATA", default_value = "data")]
        data: PathBuf,
        /// The new data dir; must not exist.
        #[arg(long)]
        into: PathBuf,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML configuration file (tokens, agents, tuning).
    #[arg(long, env = "ANIMA_CONFIG")]
    config: Option<PathBuf>,
    /// Data directory (embedded log and checkpoints). Default ./data.
    #[arg(long, env = "ANIMA_DATA")]
    data: Option<PathBuf>,
    /// gRPC listen address. Default 127.0.0.1:50051.
    #[arg(long, env = "ANIMA_LISTEN")]
    listen: Option<SocketAddr>,
    /// NATS server URL, or a cluster's servers comma-separated (nats://a:4222,nats://b:4222): use
    /// the JetStream stream there as the log instead of the embedded one.
    #[arg(long, env = "ANIMA_NATS")]
    nats: Option<String>,
    /// JetStream stream name. Default ANIMA.
    #[arg(long, env = "ANIMA_STREAM")]
    stream: Option<String>,
    /// First tokens of every subject (the stream captures PREFIX.>). Default anima.v1. Another
    /// deployment on the same NATS account needs its own --stream and its own prefix.
    #[arg(long, env = "ANIMA_SUBJECT_PREFIX")]
    subject_prefix: Option<String>,
    /// Replicas of a newly created JetStream stream. Default 1.
    #[arg(long, env = "ANIMA_REPLICAS")]
    replicas: Option<usize>,
    /// Prometheus metrics listen address (HTTP, `GET /metrics`). Default: off.
    #[arg(long, env = "ANIMA_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// PEM certificate chain: serve gRPC over TLS (with --tls-key).
    #[arg(long, env = "ANIMA_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "ANIMA_TLS_KEY")]
    tls_key: Option<PathBuf>,
}

/// Errors are printed as one readable line (the cause chain), whatever `RUST_BACKTRACE` says:
/// an operator reads "data: ... is in use", not a stack trace; the exit code is 1.
fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("anima-wake: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(cli.log_format)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    match cli.command {
        Command::Serve(args) => runtime.block_on(serve(args)),
        Command::Replay(args) => runtime.block_on(anima_gateway::replay_command::run(args)),
        Command::Digest { dir } => anima_gateway::digest_command::run(&dir),
        Command::StoreStats { data } => {
            let census = anima_engine::store_census::census(&data)
                .with_context(|| format!("store stats of {}", data.display()))?;
            print!("{}", anima_engine::store_census::render(&data, &census));
            Ok(())
        }
        Command::Compact { data, into } => compact(&data, &into),
    }
}

fn compact(data: &std::path::Path, into: &std::path::Path) -> anyhow::Result<()> {
    const MIB: f64 = 1024.0 * 1024.0;
    let started = std::time::Instant::now();
    let compaction = anima_engine::compact::compact(data, into, |tree, entries| {
        eprintln!("compact: tree {tree}: {entries} entries copied");
    })
    .with_context(|| format!("compacting {} into {}", data.display(), into.display()))?;
    println!(
        "compacted {} ({:.1} MiB on disk) into {} ({:.1} MiB on disk): {} entries in {} trees, checked, in {:.1} s",
        data.display(),
        compaction.before_bytes as f64 / MIB,
        into.display(),
        compaction.after_bytes as f64 / MIB,
        compaction.entries(),
        compaction.trees.len(),
        started.elapsed().as_secs_f64(),
    );
    println!("start the engine with --data {} (the old dir is no longer needed then)", into.display());
    Ok(())
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(data) = args.data {
        config.data = data;
    }
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if let Some(nats) = args.nats {
        config.nats = Some(nats);
    }
    if let Some(stream) = args.stream {
        config.stream = stream;
    }
    if let Some(subject_prefix) = args.subject_prefix {
        config.subject_prefix = subject_prefix;
    }
    if let Some(replicas) = args.replicas {
        config.replicas = replicas;
    }
    if let Some(metrics_listen) = args.metrics_listen {
        config.metrics_listen = Some(metrics_listen);
    }
    if let Some(tls_cert) = args.tls_cert {
        config.tls_cert = Some(tls_cert);
    }
    if let Some(tls_key) = args.tls_key {
        config.tls_key = Some(tls_key);
    }
    let server = anima_gateway::server::start(config).await?;
    // Machine-readable lines for supervisors and tests that listen on port 0; metrics first, so
    // whoever waits for the second line knows both.
    if let Some(metrics_addr) = server.metrics_addr {
        println!("anima-wake metrics on {metrics_addr}");
    }
    println!("anima-wake listening on {}", server.local_addr);
    server.run_until(shutdown_signal()).await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
