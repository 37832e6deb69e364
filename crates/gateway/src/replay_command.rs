//! `anima-wake replay`: the incident-debugging tool.
//!
//! * `timeline` — one surface's or agent's events, human-readable, with UTC times and what the
//!   fold decided for each;
//! * `state --at SEQ|TIME` — the state of an agent or a surface as of a point;
//! * `explain SEQ` — the facts of the decision at a sequence;
//! * `export --format jsonl` — one stored event per line (protobuf JSON plus the stored bytes);
//! * `verify` — rebuild from the log and compare with the checkpoint in the data dir, naming the
//!   first differing key.
//!
//! Text by default; `--json` prints JSON for scripts instead (see [`json`]).
//!
//! It reads an embedded data dir directly (`--data`, default `./data`) when no server holds it,
//! a JetStream stream directly (`--nats URL`), or goes through a server's gRPC API (`--api URL`,
//! or the API of the server holding the data dir, which it records there) — and says which on
//! stderr. Direct
//! reads and the API share the conversions of [`crate::replay_services`], so both print the same.
//! Long runs show their progress on stderr (a bar on a terminal, plain lines otherwise; see
//! [`progress`]).

mod json;
mod progress;

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anima_engine::log::jetstream::JetStreamConfig;
use anima_engine::replay::{DirectSource, ReplayConfig, ReplayError, Replayer};
use anima_projections::proto::EVENTS_DESCRIPTOR_SET;
use anima_projections::time::format_utc;
use anyhow::{bail, Context};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions, Value};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::Status;

use self::progress::{BarSafeWriter, ProgressMode, ProgressReporter};
use crate::api;
use crate::replay_services;

/// Longest content string a timeline line shows, in characters.
const TIMELINE_TEXT_CHARS_MAX: usize = 80;

#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// Data directory of an embedded server (its log and checkpoints). Default ./data.
    #[arg(long, env = "ANIMA_DATA", global = true)]
    pub data: Option<PathBuf>,
    /// Read the JetStream stream at this NATS URL (or comma-separated server list) directly.
    #[arg(long, env = "ANIMA_NATS", global = true)]
    pub nats: Option<String>,
    /// JetStream stream name.
    #[arg(long, env = "ANIMA_STREAM", default_value = "ANIMA", global = true)]
    pub stream: String,
    /// Go through a running server's gRPC API, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "ANIMA_API", global = true)]
    pub api: Option<String>,
    /// Bearer token for --api (a replay or admin token).
    #[arg(long, env = "ANIMA_TOKEN", global = true, hide_env_values = true)]
    pub token: Option<String>,
    /// Progress on stderr: a bar on a terminal, plain lines otherwise (auto), or as named.
    #[arg(long, env = "ANIMA_PROGRESS", value_enum, default_value = "auto", global = true)]
    pub progress: ProgressMode,
    /// Look at progress every this many events (how often the bar moves).
    #[arg(long, env = "ANIMA_PROGRESS_EVERY", default_value_t = 10_000, global = true)]
    pub progress_every: u64,
    /// Seconds between two plain progress lines.
    #[arg(long, env = "ANIMA_PROGRESS_INTERVAL_SECS", default_value_t = 5, global = true)]
    pub progress_interval_secs: u64,
    /// Print JSON on stdout instead of text, for scripts. timeline: JSON lines, one event per
    /// line (the lines of export --format jsonl); state, explain and verify: one JSON document.
    /// Every log time in nanoseconds (log_time_ns) has an RFC 3339 UTC time beside it
    /// (log_time); verdicts are JSON values. Progress and notes stay on stderr.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: ReplayCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum ReplayCommand {
    /// One surface's or agent's events, human-readable, with what the fold decided.
    Timeline(TimelineArgs),
    /// The state of an agent or a surface as of a sequence or a time.
    State(StateArgs),
    /// The facts of the decision at a sequence.
    Explain(ExplainArgs),
    /// Stored events as JSON lines, for other tools.
    Export(ExportArgs),
    /// Rebuild from the log and compare with the checkpoint in the data dir.
    Verify,
}

#[derive(clap::Args, Debug)]
pub struct SelectionArgs {
    /// First event: a sequence, or a UTC time like 2024-05-01T12:00:00Z.
    #[arg(long)]
    pub from: Option<String>,
    /// Last event: a sequence, or a UTC time.
    #[arg(long)]
    pub to: Option<String>,
    /// Events whose payload names this agent.
    #[arg(long)]
    pub agent: Option<String>,
    /// Events on this surface, e.g. slack:T1:C1 or slack:T1:C1:thread:1700000000.000100.
    #[arg(long)]
    pub surface: Option<String>,
    /// Only these event types (payload names: slack_message, send, wake_start, ...).
    #[arg(long = "type")]
    pub event_types: Vec<String>,
    /// At most this many events.
    #[arg(long)]
    pub limit: Option<u64>,
}

#[derive(clap::Args, Debug)]
pub struct TimelineArgs {
    #[command(flatten)]
    pub selection: SelectionArgs,
    /// Do not fold to show what was decided (faster: reads only the range).
    #[arg(long)]
    pub no_outcomes: bool,
}

#[derive(clap::Args, Debug)]
pub struct StateArgs {
    /// A sequence, or a UTC time (the newest event at or before it). Default: the newest event.
    #[arg(long)]
    pub at: Option<String>,
    #[arg(long)]
    pub agent: Option<String>,
    #[arg(long)]
    pub surface: Option<String>,
}

#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The sequence of the decision (a send, claim, start, finish, observation).
    pub seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    Jsonl,
}

#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    #[command(flatten)]
    pub selection: SelectionArgs,
    #[arg(long, value_enum, default_value = "jsonl")]
    pub format: ExportFormat,
    /// Write here instead of stdout.
    #[arg(long)]
    pub output: Option<PathBuf>,
    /// Attach each event's outcome (folds from the first event).
    #[arg(long)]
    pub outcomes: bool,
}

/// Adds the bearer token to every call through the API.
#[derive(Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", token.clone());
        }
        Ok(request)
    }
}

type ApiChannel = tonic::service::interceptor::InterceptedService<Channel, BearerToken>;

/// Where the tool reads from.
enum Source {
    // The source is kept open while the replayer reads it.
    Direct { _source: DirectSource, replayer: Replayer },
    Api { client: api::replay_client::ReplayClient<ApiChannel> },
}

fn progress_reporter(args: &ReplayArgs) -> Arc<ProgressReporter> {
    ProgressReporter::new(args.progress, Duration::from_secs(args.progress_interval_secs))
}

fn replay_config(args: &ReplayArgs, reporter: &Arc<ProgressReporter>) -> ReplayConfig {
    ReplayConfig {
        progress_every_events: args.progress_every.max(1),
        progress: reporter.callback(),
        ..ReplayConfig::default()
    }
}

async fn connect_api(url: &str, token: Option<&str>) -> anyhow::Result<Source> {
    let token = match token {
        Some(token) => Some(format!("Bearer {token}").parse().context("--token must be ASCII")?),
        None => None,
    };
    let channel = Channel::from_shared(url.to_owned())
        .with_context(|| format!("--api {url:?} is not a URL"))?
        .connect()
        .await
        .with_context(|| format!("cannot reach the anima-wake API at {url}"))?;
    eprintln!("replay: reading through the gRPC API at {url}");
    Ok(Source::Api { client: api::replay_client::ReplayClient::with_interceptor(channel, BearerToken(token)) })
}

fn data_dir(args: &ReplayArgs) -> PathBuf {
    args.data.clone().unwrap_or_else(|| PathBuf::from("./data"))
}

/// The API of the server that holds the data dir, as that server recorded it there
/// ([`crate::server::SERVING_FILE`]). Refused, with the reason, unless the record names a live
/// process and a plain-text address: any other server (say, one on the default port) may hold
/// another log, and reading it instead would answer about the wrong deployment.
fn holder_api(data: &std::path::Path, shown: &str) -> anyhow::Result<String> {
    let file = data.join(crate::server::SERVING_FILE);
    let refuse = |reason: String| {
        anyhow::anyhow!(
            "{shown} is held by a running anima-wake, but {reason}; pass --api URL (and --token) to reach it"
        )
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| refuse(format!("it has not said where it listens ({}: {e})", file.display())))?;
    let record = crate::server::ServingRecord::decode(&text)
        .ok_or_else(|| refuse(format!("{} is not a serving record", file.display())))?;
    let proc = std::path::Path::new("/proc");
    if proc.is_dir() && !proc.join(record.pid.to_string()).exists() {
        return Err(refuse(format!("the process that recorded {} (pid {}) is gone", file.display(), record.pid)));
    }
    if record.tls {
        return Err(refuse(format!("it serves TLS on {}", record.grpc)));
    }
    // A server listening on every address is reached on loopback.
    let mut addr = record.grpc;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    Ok(format!("http://{addr}"))
}

async fn direct(args: &ReplayArgs) -> Result<DirectSource, ReplayError> {
    let data = data_dir(args);
    match &args.nats {
        Some(url) => {
            anima_engine::log::jetstream::parse_servers(url)
                .map_err(|e| ReplayError::Source(format!("--nats (ANIMA_NATS): {e}")))?;
            let config =
                JetStreamConfig { url: url.clone(), stream: args.stream.clone(), ..JetStreamConfig::default() };
            DirectSource::open_jetstream(config, Some(&data)).await
        }
        None => DirectSource::open_data_dir(data),
    }
}

impl Source {
    /// The source the arguments name: the API if `--api`, else the log directly; a data dir
    /// held by a running server goes through that server's API ([`holder_api`]).
    async fn open(args: &ReplayArgs, reporter: &Arc<ProgressReporter>) -> anyhow::Result<Source> {
        if let Some(url) = &args.api {
            return connect_api(url, args.token.as_deref()).await;
        }
        match direct(args).await {
            Ok(source) => {
                eprintln!("replay: reading the {}", source.description);
                let mut replayer = Replayer::new(source.log.clone(), replay_config(args, reporter));
                if let Some(checkpoint) = source.checkpoint_store() {
                    if let Ok(Some(seq @ 1..)) = checkpoint.usable_seq(&source.log.identity()) {
                        eprintln!(
                            "replay: a state at or after seq {seq} starts from the data dir's checkpoint (its whole \
                             state is loaded first)"
                        );
                    }
                    replayer = replayer.with_checkpoint(checkpoint);
                }
                Ok(Source::Direct { _source: source, replayer })
            }
            Err(ReplayError::Locked { path }) => {
                let url = holder_api(&data_dir(args), &path)?;
                eprintln!("replay: {path} is held by a running anima-wake; going through its API at {url}");
                connect_api(&url, args.token.as_deref()).await.with_context(|| {
                    format!("{path} is held by the server at {url}; pass --api URL (and --token) to reach it")
                })
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn read(
        &self,
        request: api::ReplayReadRequest,
    ) -> anyhow::Result<BoxStream<'static, Result<api::ReplayReadResponse, Status>>> {
        match self {
            Source::Direct { replayer, .. } => {
                let query = replay_services::read_query(request)?;
                let events = replayer.read(query).await?;
                Ok(events.map(|e| e.map(replay_services::replay_event).map_err(replay_services::replay_status)).boxed())
            }
            Source::Api { client } => Ok(client.clone().read(request).await?.into_inner().boxed()),
        }
    }

    async fn state_at(&self, request: api::ReplayStateAtRequest) -> anyhow::Result<api::ReplayStateAtResponse> {
        match self {
            Source::Direct { replayer, .. } => Ok(replay_services::state_at(replayer, request).await?),
            Source::Api { client } => Ok(client.clone().state_at(request).await?.into_inner()),
        }
    }

    async fn explain(&self, seq: u64) -> anyhow::Result<api::ReplayExplainResponse> {
        match self {
            Source::Direct { replayer, .. } => Ok(replay_services::explain_response(
                replayer.explain(seq).await.map_err(replay_services::replay_status)?,
            )),
            Source::Api { client } => Ok(client.clone().explain(api::ReplayExplainRequest { seq }).await?.into_inner()),
        }
    }
}

/// Runs `anima-wake replay ...`. Output goes to stdout, progress and the source to stderr.
pub async fn run(args: ReplayArgs) -> anyhow::Result<()> {
    let reporter = progress_reporter(&args);
    let result = match &args.command {
        ReplayCommand::Verify => verify(&args, &reporter).await,
        _ => run_reading(&args, &reporter).await,
    };
    // Also when the command failed: the error is printed below the cleared bar.
    reporter.finish();
    result
}

/// The commands that read events or rebuild state: everything but `verify`.
async fn run_reading(args: &ReplayArgs, reporter: &Arc<ProgressReporter>) -> anyhow::Result<()> {
    let source = Source::open(args, reporter).await?;
    let stdout = std::io::stdout();
    let stdout_is_terminal = std::io::IsTerminal::is_terminal(&stdout);
    let mut out = std::io::BufWriter::new(BarSafeWriter::new(stdout.lock(), stdout_is_terminal, reporter.clone()));
    match &args.command {
        ReplayCommand::Timeline(timeline) => {
            if timeline.selection.agent.is_none() && timeline.selection.surface.is_none() {
                bail!("timeline needs --agent or --surface (use export for the whole log)");
            }
            let mut request = read_request(&timeline.selection)?;
            request.with_outcomes = !timeline.no_outcomes;
            let mut events = source.read(request).await?;
            let mut shown = 0u64;
            while let Some(event) = events.try_next().await? {
                if args.json {
                    writeln!(out, "{}", json_line(&event)?)?;
                } else {
                    writeln!(out, "{}", timeline_line(&event))?;
                }
                shown += 1;
            }
            out.flush()?;
            reporter.finish();
            eprintln!("replay: {shown} events");
        }
        ReplayCommand::State(state) => {
            let request = api::ReplayStateAtRequest {
                at: state.at.as_deref().map(parse_point).transpose()?,
                agent_id: state.agent.clone().unwrap_or_default(),
                surface: state.surface.clone().unwrap_or_default(),
            };
            let response = source.state_at(request).await?;
            reporter.finish();
            if args.json {
                writeln!(out, "{}", json::message_document(&response, "anima.v1.ReplayStateAtResponse")?)?;
            } else {
                write!(out, "{}", format_state(&response))?;
            }
        }
        ReplayCommand::Explain(explain) => {
            let response = source.explain(explain.seq).await?;
            reporter.finish();
            if args.json {
                writeln!(out, "{}", json::message_document(&response, "anima.v1.ReplayExplainResponse")?)?;
            } else {
                write!(out, "{}", format_explanation(&response))?;
            }
        }
        ReplayCommand::Export(export) => {
            let mut request = read_request(&export.selection)?;
            request.with_outcomes = export.outcomes;
            let mut events = source.read(request).await?;
            let mut sink: Box<dyn std::io::Write> = match &export.output {
                Some(path) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
                )),
                None => Box::new(out),
            };
            let mut written = 0u64;
            while let Some(event) = events.try_next().await? {
                writeln!(sink, "{}", json_line(&event)?)?;
                written += 1;
            }
            sink.flush()?;
            reporter.finish();
            eprintln!("replay: exported {written} events");
            return Ok(());
        }
        ReplayCommand::Verify => unreachable!("`run` runs verify itself"),
    }
    out.flush()?;
    Ok(())
}

async fn verify(args: &ReplayArgs, reporter: &Arc<ProgressReporter>) -> anyhow::Result<()> {
    if args.api.is_some() {
        bail!("verify reads the checkpoint in the data dir: run it without --api, with the server stopped");
    }
    let source = match direct(args).await {
        Ok(source) => source,
        Err(e @ ReplayError::Locked { .. }) => {
            bail!("{e}\nverify compares the data dir's checkpoint, which only a stopped server leaves still: stop it first")
        }
        Err(e) => return Err(e.into()),
    };
    eprintln!("replay: verifying the {}", source.description);
    let report = source.verify(replay_config(args, reporter)).await;
    reporter.finish();
    let report = report?;
    if args.json {
        let difference = report.first_difference.as_ref().map(|difference| {
            serde_json::json!({
                "table": difference.table,
                "key": difference.key,
                "note": difference.note,
                "checkpoint_bytes": difference.checkpoint_bytes,
                "rebuilt_bytes": difference.rebuilt_bytes,
                "first_differing_byte": difference.first_differing_byte,
            })
        });
        let document = serde_json::json!({
            "passed": report.passed(),
            "applied_seq": report.applied_seq,
            "entries": report.entries,
            "checkpoint_sha256": report.checkpoint_sha256,
            "rebuilt_sha256": report.rebuilt_sha256,
            "first_difference": difference,
        });
        println!("{document}");
    } else {
        println!(
            "checkpoint at seq {} with {} entries; checkpoint sha256 {}, rebuilt sha256 {}",
            report.applied_seq, report.entries, report.checkpoint_sha256, report.rebuilt_sha256
        );
    }
    if report.passed() {
        if args.json {
            return Ok(());
        }
        println!("verify: the rebuild equals the checkpoint, byte for byte");
        return Ok(());
    }
    match &report.first_difference {
        Some(difference) => bail!(
            "verify: DIFFERS at table {} key \"{}\": {} (checkpoint {} bytes, rebuilt {} bytes{})",
            difference.table,
            difference.key,
            difference.note,
            difference.checkpoint_bytes.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            difference.rebuilt_bytes.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            difference.first_differing_byte.map(|b| format!(", first differing byte {b}")).unwrap_or_default()
        ),
        None => bail!("verify: the canonical encodings differ, though every entry is equal"),
    }
}

fn read_request(selection: &SelectionArgs) -> anyhow::Result<api::ReplayReadRequest> {
    Ok(api::ReplayReadRequest {
        range: Some(api::ReplayRange {
            from: selection.from.as_deref().map(parse_point).transpose()?,
            to: selection.to.as_deref().map(parse_point).transpose()?,
        }),
        filter: Some(api::ReplayFilter {
            agent_id: selection.agent.clone().unwrap_or_default(),
            surface: selection.surface.clone().unwrap_or_default(),
            event_types: selection.event_types.clone(),
        }),
        with_outcomes: false,
        limit: selection.limit.unwrap_or_default(),
    })
}

/// A sequence (digits) or a UTC time `YYYY-MM-DDTHH:MM:SS[.fraction]Z` (a space for `T` and a
/// missing `Z` are accepted too).
pub fn parse_point(text: &str) -> anyhow::Result<api::ReplayPoint> {
    use api::replay_point::Point;
    let text = text.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(api::ReplayPoint { point: Some(Point::Seq(text.parse()?)) });
    }
    parse_utc_ns(text)
        .map(|ns| api::ReplayPoint { point: Some(Point::LogTimeNs(ns)) })
        .with_context(|| format!("{text:?} is neither a sequence nor a UTC time like 2024-05-01T12:00:00Z"))
}

fn parse_utc_ns(text: &str) -> anyhow::Result<i64> {
    let text = text.trim_end_matches('Z').trim_end_matches(" UTC");
    let (date, time) = text.split_once(['T', ' ']).unwrap_or((text, "00:00:00"));
    let number = |s: &str| -> anyhow::Result<i64> {
        anyhow::ensure!(!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()), "{s:?} is not a number");
        Ok(s.parse()?)
    };
    let date: Vec<&str> = date.split('-').collect();
    anyhow::ensure!(date.len() == 3, "the date must be YYYY-MM-DD");
    let (year, month, day) = (number(date[0])?, number(date[1])?, number(date[2])?);
    anyhow::ensure!((1..=12).contains(&month) && (1..=31).contains(&day), "no such date");
    let (clock, fraction) = time.split_once('.').unwrap_or((time, ""));
    let clock: Vec<&str> = clock.split(':').collect();
    anyhow::ensure!(clock.len() == 3, "the time must be HH:MM:SS");
    let (hour, minute, second) = (number(clock[0])?, number(clock[1])?, number(clock[2])?);
    anyhow::ensure!(hour < 24 && minute < 60 && second < 61, "no such time");
    let nanos = if fraction.is_empty() {
        0
    } else {
        anyhow::ensure!(fraction.len() <= 9, "at most nine fractional digits");
        number(fraction)? * 10i64.pow(9 - fraction.len() as u32)
    };
    let days = days_from_civil(year, month, day);
    Ok(((days * 86_400 + hour * 3_600 + minute * 60 + second) * 1_000_000_000) + nanos)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// RFC 3339 in UTC with milliseconds (`2023-11-14T22:13:20.500Z`): what scripts and other tools
/// parse, and what `--at` accepts back.
pub fn format_time_ns(ns: i64) -> String {
    let seconds = ns.div_euclid(1_000_000_000);
    let millis = ns.rem_euclid(1_000_000_000) / 1_000_000;
    let utc = format_utc(seconds);
    format!("{}.{millis:03}Z", utc.trim_end_matches(" UTC").replacen(' ', "T", 1))
}

fn envelope_descriptor() -> &'static MessageDescriptor {
    static ENVELOPE: OnceLock<MessageDescriptor> = OnceLock::new();
    ENVELOPE.get_or_init(|| {
        DescriptorPool::decode(EVENTS_DESCRIPTOR_SET)
            .ok()
            .and_then(|pool| pool.get_message_by_name("anima.v1.Envelope"))
            .expect("the built-in descriptor set has the envelope")
    })
}

fn clip(text: &str) -> String {
    if text.chars().count() <= TIMELINE_TEXT_CHARS_MAX {
        return format!("{text:?}");
    }
    let clipped: String = text.chars().take(TIMELINE_TEXT_CHARS_MAX).collect();
    format!("{clipped:?}…")
}

/// `name=value` for every set field of a message, nested ones dotted.
fn flatten(message: &DynamicMessage, prefix: &str, out: &mut Vec<String>) {
    for (field, value) in message.fields() {
        let name = format!("{prefix}{}", field.name());
        flatten_value(&field, value, &name, out);
    }
}

fn flatten_value(field: &prost_reflect::FieldDescriptor, value: &Value, name: &str, out: &mut Vec<String>) {
    match value {
        Value::Message(inner) => flatten(inner, &format!("{name}."), out),
        Value::List(items) => {
            for (index, item) in items.iter().enumerate() {
                flatten_value(field, item, &format!("{name}[{index}]"), out);
            }
        }
        Value::String(s) => out.push(format!("{name}={}", clip(s))),
        Value::Bytes(b) => out.push(format!("{name}=<{} bytes>", b.len())),
        Value::EnumNumber(n) => {
            let label = match field.kind() {
                prost_reflect::Kind::Enum(e) => e.get_value(*n).map(|v| v.name().to_owned()),
                _ => None,
            };
            out.push(format!("{name}={}", label.unwrap_or_else(|| n.to_string())));
        }
        Value::Map(entries) => out.push(format!("{name}=<{} entries>", entries.len())),
        other => out.push(format!("{name}={}", scalar(other))),
    }
}

fn scalar(value: &Value) -> String {
    match value {
        Value::Bool(b) => b.to_string(),
        Value::I32(n) => n.to_string(),
        Value::I64(n) => n.to_string(),
        Value::U32(n) => n.to_string(),
        Value::U64(n) => n.to_string(),
        Value::F32(n) => n.to_string(),
        Value::F64(n) => n.to_string(),
        _ => String::new(),
    }
}

/// The payload's fields of a stored event, for a timeline line.
fn payload_summary(stored: &[u8]) -> String {
    let Ok(envelope) = DynamicMessage::decode(envelope_descriptor().clone(), stored) else {
        return "<does not decode>".to_owned();
    };
    let mut parts = Vec::new();
    for (field, value) in envelope.fields() {
        if field.containing_oneof().is_some_and(|o| o.name() == "payload") {
            if let Value::Message(payload) = value {
                flatten(payload, "", &mut parts);
            }
        }
    }
    parts.join(" ")
}

pub fn describe_outcome(outcome: &api::AnalyticsOutcome) -> String {
    let mut details = Vec::new();
    if !outcome.wake_reason.is_empty() {
        details.push(format!("wake {}", outcome.wake_reason));
    }
    if !outcome.refusal.is_empty() {
        details.push(outcome.refusal.clone());
    }
    if outcome.kind == "send_held" {
        details.push(format!("{} new, {} shown, {} omitted", outcome.new_messages, outcome.shown, outcome.omitted));
    }
    if outcome.ordinal > 0 {
        details.push(format!("row #{}", outcome.ordinal));
    }
    if outcome.duplicate_message {
        details.push("duplicate message".to_owned());
    }
    if outcome.note_shown {
        details.push("with a mute suggestion".to_owned());
    }
    if outcome.settled_without_turn > 0 {
        details.push(format!("{} settled without a turn", outcome.settled_without_turn));
    }
    if details.is_empty() {
        outcome.kind.clone()
    } else {
        format!("{} ({})", outcome.kind, details.join(", "))
    }
}

/// One line of `timeline`.
pub fn timeline_line(event: &api::ReplayReadResponse) -> String {
    let mut line = format!(
        "{:>8}  {}  {:<16} {}",
        event.seq,
        format_time_ns(event.log_time_ns),
        event.event_type,
        payload_summary(&event.stored)
    );
    if let Some(outcome) = &event.outcome {
        line.push_str("  => ");
        line.push_str(&describe_outcome(outcome));
    }
    line
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// One line of `export --format jsonl` (and of `timeline --json`): the position, the event as
/// protobuf JSON (proto field names), the stored bytes (base64, for a newer schema), and the
/// outcome and the recorded verdict (a JSON value) when asked.
pub fn json_line(event: &api::ReplayReadResponse) -> anyhow::Result<String> {
    let event_json = match DynamicMessage::decode(envelope_descriptor().clone(), event.stored.as_slice()) {
        Ok(message) => {
            let mut buffer = Vec::new();
            let mut serializer = serde_json::Serializer::new(&mut buffer);
            let options = SerializeOptions::new().use_proto_field_name(true);
            message.serialize_with_options(&mut serializer, &options)?;
            String::from_utf8(buffer)?
        }
        Err(_) => "null".to_owned(),
    };
    // Every field of the outcome, as `state --json` prints messages.
    let outcome = match &event.outcome {
        Some(o) => format!(",\"outcome\":{}", json::message_document(o, "anima.v1.AnalyticsOutcome")?),
        None => String::new(),
    };
    // The verdict is the fold's structure as JSON text: embedded as a value, not a string.
    let verdict = if event.verdict.is_empty() {
        String::new()
    } else {
        let value: serde_json::Value =
            serde_json::from_str(&event.verdict).unwrap_or_else(|_| serde_json::Value::String(event.verdict.clone()));
        format!(",\"verdict\":{value}")
    };
    Ok(format!(
        "{{\"seq\":{},\"subject\":{},\"log_time_ns\":{},\"log_time\":{},\"event_type\":{},\"event\":{},\
         \"stored_base64\":\"{}\"{}{}}}",
        event.seq,
        serde_json::to_string(&event.subject)?,
        event.log_time_ns,
        serde_json::to_string(&format_time_ns(event.log_time_ns))?,
        serde_json::to_string(&event.event_type)?,
        event_json,
        base64(&event.stored),
        outcome,
        verdict
    ))
}

fn cursor_line(cursor: &api::ReplayCursor, by_agent: bool) -> String {
    let who = if by_agent { &cursor.surface } else { &cursor.agent_id };
    format!("    {who}  {} of {}\n", cursor.cursor, cursor.tail)
}

fn wake_line(item: &api::ReplayWakeItem) -> String {
    format!(
        "{}  {}  trigger #{} on {} (seq {}), reply to {}, queued at seq {} ({}){}",
        item.item_id,
        item.reason,
        item.trigger_ordinal,
        item.trigger_surface,
        item.trigger_seq,
        item.reply_to,
        item.queued_seq,
        format_time_ns(item.queued_log_time_ns),
        if item.resume_after_restart { ", resumes after a restart" } else { "" }
    )
}

fn row_line(row: &api::ReplayRow) -> String {
    let author = if !row.owner.is_empty() {
        format!("agent {}", row.owner)
    } else if !row.user_id.is_empty() {
        format!("user {}", row.user_id)
    } else {
        format!("bot {}", row.bot_id)
    };
    format!(
        "    #{} seq {} {} ts {} by {}{} ({} bytes)\n",
        row.ordinal,
        row.seq,
        format_time_ns(row.log_time_ns),
        row.ts,
        author,
        if row.foreign { ", foreign" } else { "" },
        row.body_bytes
    )
}

/// `state` output.
pub fn format_state(state: &api::ReplayStateAtResponse) -> String {
    let mut out = format!(
        "state as of seq {} ({}), fold version {}, sha256 {}\n{} agents, {} surfaces, {} cursors, {} verdicts kept\n",
        state.as_of_seq,
        format_time_ns(state.as_of_log_time_ns),
        state.fold_version,
        state.state_sha256,
        state.agents,
        state.surfaces,
        state.cursors,
        state.verdicts_kept
    );
    if !state.halted.is_empty() {
        out.push_str(&format!("the fold stopped deciding {}\n", state.halted));
    }
    if let Some(agent) = &state.agent {
        if agent.registered {
            out.push_str(&format!(
                "agent {} (registered at seq {}; slack user {}, bot {})\n",
                agent.agent_id, agent.registered_seq, agent.slack_bot_user_id, agent.slack_bot_id
            ));
        } else {
            out.push_str(&format!("agent {} is not registered\n", agent.agent_id));
        }
        out.push_str(&format!("  cursors ({}):\n", agent.cursors.len()));
        for cursor in &agent.cursors {
            out.push_str(&cursor_line(cursor, true));
        }
        out.push_str(&format!("  queued ({}):\n", agent.queued.len()));
        for item in &agent.queued {
            out.push_str(&format!("    {}\n", wake_line(item)));
        }
        match &agent.active {
            None => out.push_str("  active: none\n"),
            Some(active) => {
                let item = active.item.as_ref().map(wake_line).unwrap_or_default();
                let started = if active.started_seq > 0 {
                    format!("started at seq {}", active.started_seq)
                } else {
                    "not started".to_owned()
                };
                out.push_str(&format!(
                    "  active: {item}\n    worker {}, claimed at seq {}, {started}\n",
                    active.worker_id, active.claimed_seq
                ));
                for entry in &active.plan {
                    let expected =
                        if entry.expected_present { entry.expected_ordinal.to_string() } else { "absent".to_owned() };
                    out.push_str(&format!(
                        "    plan {}: expects {expected}, moves to {}\n",
                        entry.surface, entry.target_ordinal
                    ));
                }
            }
        }
        out.push_str(&format!("  settled ids remembered: {}\n", agent.settled_remembered));
        out.push_str(&format!("  subscriptions ({}):\n", agent.subscriptions.len()));
        for subscription in &agent.subscriptions {
            out.push_str(&format!("    {subscription}\n"));
        }
        out.push_str(&format!("  memory pass: {}\n", agent.memory_gate));
    }
    if let Some(surface) = &state.surface {
        out.push_str(&format!("surface {}: tail {}", surface.surface, surface.tail));
        if !surface.trailing_owner.is_empty() {
            out.push_str(&format!(", trailing run by {} from #{}", surface.trailing_owner, surface.trailing_run_start));
        }
        out.push('\n');
        out.push_str(&format!("  cursors ({}):\n", surface.cursors.len()));
        for cursor in &surface.cursors {
            out.push_str(&cursor_line(cursor, false));
        }
        out.push_str(&format!("  recent rows ({}):\n", surface.recent_rows.len()));
        for row in &surface.recent_rows {
            out.push_str(&row_line(row));
        }
    }
    out
}

/// `explain` output.
pub fn format_explanation(explanation: &api::ReplayExplainResponse) -> String {
    let mut out = format!(
        "seq {} ({}) {} on {}\n",
        explanation.seq,
        format_time_ns(explanation.log_time_ns),
        explanation.event_type,
        explanation.subject
    );
    let decision = explanation.outcome.as_ref().map(describe_outcome).unwrap_or_else(|| "no verdict".to_owned());
    out.push_str(&format!("decision: {decision}\n"));
    if !explanation.facts.is_empty() {
        out.push_str("facts:\n");
        for fact in &explanation.facts {
            out.push_str(&format!("  - {fact}\n"));
        }
    }
    if !explanation.surface.is_empty() {
        let cursor = if explanation.cursor_present { explanation.cursor.to_string() } else { "absent".to_owned() };
        out.push_str(&format!(
            "cursor of {} on {}: {cursor}, tail {}, {} foreign rows after it\n",
            explanation.agent_id, explanation.surface, explanation.tail, explanation.foreign_rows_after_cursor
        ));
        for row in &explanation.rows_after_cursor {
            out.push_str(&row_line(row));
        }
    }
    out.push_str(&format!("verdict: {}\n", if explanation.verdict.is_empty() { "-" } else { &explanation.verdict }));
    if !explanation.live_verdict.is_empty() {
        out.push_str(&format!("live instance's verdict: {}\n", explanation.live_verdict));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_parse_as_sequences_or_utc_times() {
        use api::replay_point::Point;
        assert_eq!(parse_point("42").unwrap().point, Some(Point::Seq(42)));
        assert_eq!(parse_point("1970-01-01T00:00:01Z").unwrap().point, Some(Point::LogTimeNs(1_000_000_000)));
        assert_eq!(
            parse_point("2023-11-14 22:13:20.5").unwrap().point,
            Some(Point::LogTimeNs(1_700_000_000_500_000_000))
        );
        assert!(parse_point("yesterday").is_err());
        assert_eq!(format_time_ns(1_700_000_000_500_000_000), "2023-11-14T22:13:20.500Z");
        // What the tool prints, it reads back.
        assert_eq!(
            parse_point(&format_time_ns(1_700_000_000_500_000_000)).unwrap().point,
            Some(Point::LogTimeNs(1_700_000_000_500_000_000))
        );
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }
}
