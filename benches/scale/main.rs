//! `anima-scale`: the scale figure. A history of many events over many surfaces and agents is
//! written straight into an embedded data dir (through the engine's own log and runner, which
//! folds and checkpoints it as `serve` would), then the real `anima-wake serve` is started on it
//! and measured: time from spawn to serving (restart from the checkpoint), RSS after start and
//! after the sends, and the p50 of sequential `Sends.Send` calls. The same is measured on an
//! engine whose log holds only the registrations ("empty"), in the same run, and the Send p50s
//! are reported as a ratio: of all sends, and of the allowed sends only. On the full history some
//! sends are held (the DM moved since the agent last looked), and a held answer renders what was
//! missed from the log, which a send on the empty engine never does; the allowed sends are the
//! same work on both engines.

#[path = "../load/engine.rs"]
#[allow(dead_code)]
mod engine;
#[path = "../load/nats.rs"]
#[allow(dead_code)]
mod nats;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anima_engine::instance::{Backend, Instance, InstanceConfig};
use anima_engine::log::embedded::EmbeddedConfig;
use anima_engine::log::AppendRecord;
use anima_engine::subject::{SubjectPrefix, Subjects};
use anima_engine::testing::SeededRng;
use anima_gateway::api;
use anima_gateway::api::sends_client::SendsClient;
use anima_projections::proto::{self, envelope::Payload};
use anyhow::Context as _;
use clap::Parser;
use prost::Message;

use crate::engine::{
    log_field, log_line, rss_kib, scrape_fold, EngineProcess, FoldProbe, LogBackend, Padding, StopSteps,
};

/// Events appended per log batch while the history is written.
const APPEND_CHUNK: usize = 5_000;
/// DM surfaces per agent; the rest of the surfaces are shared channels.
const TEAM: &str = "T0SCALE";

#[derive(Debug, Parser)]
#[command(name = "anima-scale")]
struct Args {
    /// The `anima-wake` binary (default: the one next to this executable).
    #[arg(long)]
    binary: Option<PathBuf>,
    /// Events in the history (registrations included).
    #[arg(long, default_value_t = 1_000_000)]
    events: usize,
    /// Surfaces the messages are spread over (DMs, each of one agent).
    #[arg(long, default_value_t = 100_000)]
    surfaces: usize,
    /// Agents registered.
    #[arg(long, default_value_t = 10_000)]
    agents: usize,
    /// Sequential `Sends.Send` calls measured on each engine.
    #[arg(long, default_value_t = 2_000)]
    sends: usize,
    /// Keep the two data dirs here (`DIR/full`, `DIR/empty`); when they exist already (written
    /// by an earlier run with the same arguments) they are measured as they are.
    #[arg(long)]
    data: Option<PathBuf>,
    /// The engine's `[runner] memory_budget_mib` for both engines.
    #[arg(long, default_value_t = 1024)]
    memory_budget_mib: u64,
}

fn dm_of(surface: usize, agents: usize) -> (usize, String) {
    (surface % agents, format!("D{surface:08}"))
}

/// The subjects of the fresh logs benchmarks fill: the default prefix and the newest encoding.
fn subjects() -> Subjects {
    Subjects::newest(SubjectPrefix::default())
}

fn record(subject: String, id: String, payload: Payload) -> AppendRecord {
    let envelope = proto::Envelope {
        event_id: id.clone(),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "anima-scale".into(),
        payload: Some(payload),
    };
    AppendRecord { subject, msg_id: id, payload: envelope.encode_to_vec().into() }
}

fn registration(agent: usize) -> AppendRecord {
    let id = format!("a{agent}");
    record(
        subjects().agent(&id),
        format!("reg-{agent}"),
        Payload::AgentRegistered(proto::AgentRegistered {
            agent_id: id,
            slack_bot_user_id: format!("UB{agent:07}"),
            display_name: format!("Agent {agent}"),
            ..Default::default()
        }),
    )
}

/// Event `n` of the history after the registrations: mostly people writing into DMs, some sends
/// by the DM's agent into it.
fn history_event(n: usize, random: &mut SeededRng, args: &Args) -> AppendRecord {
    let surface = random.below(args.surfaces as u64) as usize;
    let (agent, channel) = dm_of(surface, args.agents);
    if random.below(10) == 0 {
        let send = proto::SendRequested {
            agent_id: format!("a{agent}"),
            target: Some(proto::ReplyTarget {
                target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
                    team_id: TEAM.into(),
                    channel_id: channel.clone(),
                    thread_ts: String::new(),
                })),
            }),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 80,
            mentioned_user_ids: Vec::new(),
        };
        return record(subjects().slack_surface(TEAM, &channel, None), format!("h-{n}"), Payload::Send(send));
    }
    let message = proto::SlackMessageObserved {
        receiving_agent_id: format!("a{agent}"),
        kind: proto::SlackDeliveryKind::Message as i32,
        team_id: TEAM.into(),
        channel_id: channel.clone(),
        ts: format!("{}.{:06}", 1_700_000_000 + n / 1_000, n % 1_000),
        user_id: format!("U{:05}", random.below(50_000)),
        user_name: "someone".into(),
        text: format!("message {n} about the deploy"),
        ..Default::default()
    };
    record(subjects().slack_surface(TEAM, &channel, None), format!("h-{n}"), Payload::SlackMessage(message))
}

/// Agents whose wakes are worked after each appended chunk: claimed, started with the plan the
/// claim handed out, finished — so queues stay as short as a working fleet keeps them.
const WORKED_PER_CHUNK: usize = 1_000;

/// Appends `records` and waits until the fold applied them; returns their seqs.
async fn append_folded(instance: &Instance, records: Vec<AppendRecord>) -> anyhow::Result<Vec<u64>> {
    let appended = instance.engine.log().append_batch(records).await.context("append")?;
    let seqs: Vec<u64> = appended.iter().map(|a| a.seq()).collect();
    if let Some(last) = seqs.iter().max() {
        instance.engine.projection().wait_applied(*last, Duration::from_secs(300)).await?;
    }
    Ok(seqs)
}

/// One round of work for `agents`: a claim each, then a start of every wake claimed, then a
/// finish of every wake started.
async fn work_wakes(instance: &Instance, agents: impl Iterator<Item = usize>, round: usize) -> anyhow::Result<()> {
    use anima_projections::verdict::{ClaimVerdict, Verdict};
    let claims: Vec<(String, AppendRecord)> = agents
        .map(|agent| {
            let id = format!("a{agent}");
            let claim = proto::WakeClaimRequested { agent_id: id.clone(), worker_id: "w".into(), ..Default::default() };
            let record = record(subjects().agent(&id), format!("c-{round}-{agent}"), Payload::WakeClaim(claim));
            (id, record)
        })
        .collect();
    let (ids, records): (Vec<String>, Vec<AppendRecord>) = claims.into_iter().unzip();
    let seqs = append_folded(instance, records).await?;
    let mut starts = Vec::new();
    let mut finishes = Vec::new();
    {
        let state = instance.engine.projection().state();
        for (id, seq) in ids.iter().zip(seqs) {
            if let Some(Verdict::Claim(ClaimVerdict::Claimed(claimed))) = state.verdict(seq) {
                let item_id = claimed.item.id.clone();
                let start = proto::WakeStartRequested {
                    agent_id: id.clone(),
                    worker_id: "w".into(),
                    item_id: item_id.clone(),
                    plan: claimed.plan.iter().map(|p| p.to_plan_surface()).collect(),
                };
                starts.push(record(subjects().agent(id), format!("s-{round}-{id}"), Payload::WakeStart(start)));
                let finish = proto::WakeFinishRequested {
                    agent_id: id.clone(),
                    worker_id: "w".into(),
                    item_id,
                    outcome: proto::WakeOutcome::Completed as i32,
                    ..Default::default()
                };
                finishes.push(record(subjects().agent(id), format!("f-{round}-{id}"), Payload::WakeFinish(finish)));
            }
        }
    }
    if !starts.is_empty() {
        append_folded(instance, starts).await?;
        append_folded(instance, finishes).await?;
    }
    Ok(())
}

/// Writes the history into `data` through the engine's log and runner, waits until it is folded
/// and checkpointed, and closes the data dir.
async fn write_history(data: &Path, args: &Args, events: usize) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let instance = Instance::start(InstanceConfig::new(data, Backend::Embedded(EmbeddedConfig::default())))
        .await
        .context("open the data dir")?;
    let mut random = SeededRng(0x5ca1e);
    let mut batch = Vec::with_capacity(APPEND_CHUNK);
    let mut reported = Instant::now();
    let mut round = 0;
    let mut written = 0;
    while written < events {
        let n = written;
        batch.push(if n < args.agents { registration(n) } else { history_event(n, &mut random, args) });
        written += 1;
        if batch.len() == APPEND_CHUNK || written == events {
            append_folded(&instance, std::mem::take(&mut batch)).await?;
            if n >= args.agents && written < events {
                let first = round * WORKED_PER_CHUNK;
                let agents = (first..first + WORKED_PER_CHUNK.min(args.agents)).map(|a| a % args.agents);
                work_wakes(&instance, agents, round).await?;
                round += 1;
            }
            if reported.elapsed() >= Duration::from_secs(5) {
                eprintln!("  … {written} of {events} events written and folded");
                reported = Instant::now();
            }
        }
    }
    eprintln!(
        "  the log holds {} events: {events} of history and the claims, starts and finishes of {round} rounds of work",
        instance.engine.projection().applied_seq()
    );
    instance.close(Duration::from_secs(60)).await.context("close the data dir")?;
    Ok(started.elapsed())
}

struct Measured {
    start: Duration,
    /// From the spawn to the first Send's answer: the first append after a start waits for the
    /// embedded log's read of its dedupe window's msg ids.
    first_send: Duration,
    rss_started_mib: f64,
    rss_after_mib: f64,
    send_p50_ms: f64,
    send_p99_ms: f64,
    /// Sends the fold held (the surface had moved since the agent last looked: the answer shows
    /// what was missed, read from the log), and their p50.
    held: usize,
    held_p50_ms: Option<f64>,
    /// Sends the fold allowed, and their p50.
    allowed: usize,
    allowed_p50_ms: Option<f64>,
    /// The fold state's own estimate of its memory after the sends, MiB.
    state_after_mib: f64,
    /// The fold's reads back from the checkpoint store during the sends: reads, entries, seconds.
    cold: (u64, u64, f64),
    /// The steps of the start, as the engine logged them.
    steps: StartSteps,
    /// The stop after the sends.
    stop: StopSteps,
}

/// The steps of an engine's start: from its metrics, the checkpoint store's open and the restore;
/// from its log lines (`None`: the line was not found), the dedupe window's read and a padding.
/// The checkpoint store's open and the log's open run at once; the restore follows both; the
/// dedupe window's ids are read on the log's writer thread from the log's open on, beside the
/// rest, and the first append waits for them.
#[derive(Debug, Default)]
struct StartSteps {
    /// The checkpoint store's open (ms) and the journal it read to open (MiB).
    store_open_ms: f64,
    store_journal_mib: f64,
    /// The restore of the fold's state from the checkpoint (ms).
    restore_ms: f64,
    /// The dedupe window's msg ids: how many, and how long their read took (ms).
    window_ids: Option<f64>,
    window_ms: Option<f64>,
    /// The padding of a long journal the open read (after a crash), logged once it is done.
    padded: Option<Padding>,
}

impl StartSteps {
    fn from(metrics: &FoldProbe, log: &str) -> StartSteps {
        let field = |line: Option<&str>, name: &str| log_field(line, name)?.parse::<f64>().ok();
        let window = log_line(log, "read the dedupe window's msg ids");
        StartSteps {
            store_open_ms: metrics.store_open_seconds * 1e3,
            store_journal_mib: metrics.journal_read_at_open_bytes as f64 / (1024.0 * 1024.0),
            restore_ms: metrics.restore_seconds * 1e3,
            window_ids: field(window, "ids"),
            window_ms: field(window, "took_ms"),
            padded: Padding::from_log(log, "start"),
        }
    }

    fn describe(&self) -> String {
        let shown = |value: Option<f64>, decimals: usize, unit: &str| {
            value.map_or_else(|| "?".to_owned(), |value| format!("{value:.decimals$}{unit}"))
        };
        format!(
            "checkpoint store opened in {:.0} ms (its journal {:.1} MiB), state restored in {:.0} ms after it; dedupe window: {} msg ids read in {}{}",
            self.store_open_ms,
            self.store_journal_mib,
            self.restore_ms,
            shown(self.window_ids, 0, ""),
            shown(self.window_ms, 0, " ms"),
            self.padded.as_ref().map(|padded| format!("; after it, {}", padded.describe())).unwrap_or_default()
        )
    }
}

/// Starts `anima-wake serve` on `data`, times it to serving, and measures sequential Sends.
async fn measure(binary: &Path, data: &Path, args: &Args) -> anyhow::Result<Measured> {
    let config = format!("[runner]\nmemory_budget_mib = {}\n", args.memory_budget_mib);
    let started = Instant::now();
    let engine = EngineProcess::start_on(binary, LogBackend::Embedded, None, &config, Some(data)).await?;
    let start = started.elapsed();
    let rss_started_mib = rss_kib(engine.pid).unwrap_or(0) as f64 / 1024.0;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", engine.grpc_addr))?.connect().await?;
    let mut sends = SendsClient::new(channel);
    let mut random = SeededRng(0x5e4d);
    let mut latencies = Vec::with_capacity(args.sends);
    let before = scrape_fold(engine.metrics_addr).await?;
    let mut held = Vec::new();
    let mut allowed = Vec::new();
    let mut first_send = None;
    for _ in 0..args.sends {
        let (agent, channel) = dm_of(random.below(args.surfaces as u64) as usize, args.agents);
        let request = api::SendRequest {
            agent_id: format!("a{agent}"),
            target: Some(api::ReplyTarget {
                target: Some(api::reply_target::Target::Slack(api::SlackTarget {
                    team_id: TEAM.into(),
                    channel_id: channel,
                    thread_ts: String::new(),
                })),
            }),
            kind: api::SendKind::Message as i32,
            draft_bytes: 80,
            mentioned_user_ids: Vec::new(),
            request_id: String::new(),
        };
        let sent = Instant::now();
        let answer = sends.send(request).await.context("Sends.Send")?.into_inner();
        let took_ms = sent.elapsed().as_secs_f64() * 1e3;
        first_send.get_or_insert_with(|| started.elapsed());
        latencies.push(took_ms);
        match answer.verdict {
            Some(api::send_response::Verdict::Held(_)) => held.push(took_ms),
            Some(api::send_response::Verdict::Allowed(_)) => allowed.push(took_ms),
            _ => {}
        }
    }
    latencies.sort_by(f64::total_cmp);
    let p50 = |mut of: Vec<f64>| {
        of.sort_by(f64::total_cmp);
        of.get(of.len().saturating_sub(1) / 2).copied()
    };
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    let (held_count, allowed_count) = (held.len(), allowed.len());
    let (held_p50_ms, allowed_p50_ms) = (p50(held), p50(allowed));
    let rss_after_mib = rss_kib(engine.pid).unwrap_or(0) as f64 / 1024.0;
    let after = scrape_fold(engine.metrics_addr).await?;
    let cold = (
        after.cold_reads.saturating_sub(before.cold_reads),
        after.cold_read_entries.saturating_sub(before.cold_read_entries),
        after.cold_read_seconds - before.cold_read_seconds,
    );
    let state_after_mib = after.state_estimate_bytes as f64 / (1024.0 * 1024.0);
    let (send_p50_ms, send_p99_ms) = (at(0.5), at(0.99));
    let steps = StartSteps::from(&before, &engine.stderr_text());
    let stop = StopSteps::from(&engine.stop().await?);
    Ok(Measured {
        start,
        first_send: first_send.unwrap_or_default(),
        rss_started_mib,
        rss_after_mib,
        send_p50_ms,
        send_p99_ms,
        held: held_count,
        held_p50_ms,
        allowed: allowed_count,
        allowed_p50_ms,
        state_after_mib,
        cold,
        steps,
        stop,
    })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.agents >= 1 && args.surfaces >= args.agents, "need at least one surface per agent");
    anyhow::ensure!(args.events > args.agents, "the history must be longer than the registrations");
    anyhow::ensure!(args.sends >= 1, "--sends must be at least 1");
    let binary = match &args.binary {
        Some(binary) => binary.clone(),
        None => engine::default_binary()?,
    };
    engine::check_binary(&binary)?;
    let temporary = tempfile::Builder::new().prefix("anima-scale-").tempdir()?;
    let root = args.data.clone().unwrap_or_else(|| temporary.path().to_path_buf());
    let (big, empty) = (root.join("full"), root.join("empty"));
    if big.exists() && empty.exists() {
        eprintln!("anima-scale: measuring the histories already in {}", root.display());
    } else {
        eprintln!(
            "anima-scale: writing {} events over {} surfaces and {} agents",
            args.events, args.surfaces, args.agents
        );
        let wrote = write_history(&big, &args, args.events).await?;
        eprintln!(
            "  written and folded in {:.1} s ({:.0} ev/s)",
            wrote.as_secs_f64(),
            args.events as f64 / wrote.as_secs_f64()
        );
        write_history(&empty, &args, args.agents).await?;
    }
    eprintln!("anima-scale: measuring the engine on the full history, then on the registrations only");
    let full = measure(&binary, &big, &args).await?;
    let bare = measure(&binary, &empty, &args).await?;
    println!(
        "== anima-scale ({} events, {} surfaces, {} agents, memory_budget_mib {}) ==",
        args.events, args.surfaces, args.agents, args.memory_budget_mib
    );
    for (name, m) in [("full history", &full), ("registrations only", &bare)] {
        println!(
            "{name:>20}: spawn → serving {:.3} s, → first Send answered {:.3} s, RSS at start {:.0} MiB, after {} sends {:.0} MiB, Send p50 {:.2} ms p99 {:.2} ms",
            m.start.as_secs_f64(),
            m.first_send.as_secs_f64(),
            m.rss_started_mib,
            args.sends,
            m.rss_after_mib,
            m.send_p50_ms,
            m.send_p99_ms
        );
        let (reads, entries, seconds) = m.cold;
        let per_send = |n: f64| n / args.sends as f64;
        println!(
            "{:>20}  {} of the sends held{}; fold state {:.0} MiB by its estimate; per Send {:.1} reads back from the checkpoint store ({:.1} entries, {:.0} µs)",
            "",
            m.held,
            m.held_p50_ms.map(|p50| format!(" (their p50 {p50:.2} ms)")).unwrap_or_default(),
            m.state_after_mib,
            per_send(reads as f64),
            per_send(entries as f64),
            per_send(seconds * 1e6)
        );
        println!("{:>20}  start: {}", "", m.steps.describe());
        println!("{:>20}  stop: {}", "", m.stop.describe());
    }
    let allowed_ratio = full.allowed_p50_ms.zip(bare.allowed_p50_ms).map(|(full, bare)| full / bare);
    println!(
        "allowed Send p50 ratio full/empty: {} (the same work on both engines: {} and {} allowed sends)",
        allowed_ratio.map_or_else(|| "none allowed on one of them".to_owned(), |ratio| format!("{ratio:.2}")),
        full.allowed,
        bare.allowed
    );
    println!(
        "Send p50 ratio full/empty: {:.2} (target ≤ 1.2); restart {:.3} s to serving (target ≤ 0.5 s), {:.3} s to the first Send answered; RSS {:.0} MiB (target ≤ 1024)",
        full.send_p50_ms / bare.send_p50_ms,
        full.start.as_secs_f64(),
        full.first_send.as_secs_f64(),
        full.rss_after_mib
    );
    Ok(())
}
