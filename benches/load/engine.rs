//! The engine under load: the real `anima-wake serve` binary started by the tool on loopback
//! (gRPC and `/metrics` on ports the kernel picks, a temporary data dir, optionally its own
//! `nats-server`, see `nats.rs`), probed for its fold lag and RSS, and stopped with SIGTERM so it writes its last
//! checkpoint. Nothing is left running: the child is killed on drop if a stop never happened.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anima_engine::budget;
use anyhow::{bail, Context as _};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

use crate::nats::NatsServer;

/// How long the engine may take to print its listening line (a JetStream stream is created, the
/// fold catches up on an empty log).
const START_WAIT_MAX: Duration = Duration::from_secs(60);
/// How long a SIGTERM'd engine may take to drain and write its last checkpoint before it is
/// killed.
const STOP_WAIT_MAX: Duration = Duration::from_secs(30);
/// One scrape of `/metrics`; a slower answer counts as a failed probe.
const SCRAPE_WAIT_MAX: Duration = Duration::from_secs(2);
/// The engine's log filter unless `ANIMA_LOG` is set: warnings, and the lines its start logs
/// once (the checkpoint store's open, the restore, the log's open and its dedupe window), which
/// `anima-scale` reads back.
const ENGINE_LOG_DEFAULT: &str =
    "warn,anima_engine::checkpoint=info,anima_engine::projection=info,anima_engine::log::embedded=info";

/// The end of the engine's stderr shown when it fails.
const STDERR_TAIL_BYTES_MAX: usize = 4_000;

/// Where the engine keeps its log.
#[derive(Clone, Debug)]
pub enum LogBackend {
    Embedded,
    /// JetStream at this URL.
    JetStream(String),
}

/// A running `anima-wake serve` the tool started.
pub struct EngineProcess {
    child: Child,
    pub pid: u32,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    stderr_path: PathBuf,
    /// The data dir and the config; removed after the process stopped.
    _dir: tempfile::TempDir,
    /// A `nats-server` the tool started for this run; stopped after the engine.
    nats: Option<NatsServer>,
}

/// The `anima-wake` next to this executable (`target/<profile>/`).
pub fn default_binary() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("the path of this executable")?;
    let dir = exe.parent().context("the directory of this executable")?;
    Ok(dir.join(format!("anima-wake{}", std::env::consts::EXE_SUFFIX)))
}

/// Fails with how to build it when `binary` is missing.
pub fn check_binary(binary: &Path) -> anyhow::Result<()> {
    if !binary.is_file() {
        bail!(
            "{} not found: build it with `cargo build --release -p anima-gateway --bin anima-wake` \
             (or pass --binary PATH)",
            binary.display()
        );
    }
    Ok(())
}

impl EngineProcess {
    /// The process id of the `nats-server` the tool started for this run, if it did.
    pub fn nats_pid(&self) -> Option<u32> {
        self.nats.as_ref().and_then(NatsServer::pid)
    }

    /// Starts `binary serve` with a config of no agents (the load registers its agents through
    /// `Ingest.Append`) and waits until it serves.
    pub async fn start(
        binary: &Path,
        backend: LogBackend,
        nats: Option<NatsServer>,
        extra_config: &str,
    ) -> anyhow::Result<EngineProcess> {
        Self::start_on(binary, backend, nats, extra_config, None).await
    }

    /// As [`EngineProcess::start`], on the data dir `data` when given (kept afterwards) instead
    /// of a fresh one.
    pub async fn start_on(
        binary: &Path,
        backend: LogBackend,
        nats: Option<NatsServer>,
        extra_config: &str,
        data: Option<&Path>,
    ) -> anyhow::Result<EngineProcess> {
        check_binary(binary)?;
        let dir = tempfile::Builder::new().prefix("anima-load-").tempdir().context("create a temporary data dir")?;
        let config = dir.path().join("anima.toml");
        // No tokens: every loopback caller is an admin. No memory-pass scheduler: its wakes would
        // mix into the runtime loops' claims with digests the load cannot give.
        std::fs::write(&config, format!("{extra_config}\n[memoryCoherence]\ntickSeconds = 0\n"))
            .context("write the engine config")?;
        let stderr_path = dir.path().join("engine.stderr");
        let stderr = std::fs::File::create(&stderr_path).context("create the engine's stderr file")?;
        let mut command = Command::new(binary);
        command
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--data")
            .arg(data.map_or_else(|| dir.path().join("data"), Path::to_path_buf))
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--metrics-listen")
            .arg("127.0.0.1:0")
            .env("ANIMA_LOG", std::env::var("ANIMA_LOG").unwrap_or_else(|_| ENGINE_LOG_DEFAULT.into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            // Its own process group: a Ctrl-C at the terminal reaches only the tool, which stops
            // the load first and then the engine with SIGTERM.
            .process_group(0)
            .kill_on_drop(true);
        if let LogBackend::JetStream(url) = &backend {
            command.arg("--nats").arg(url);
        }
        let mut child = command.spawn().with_context(|| format!("start {}", binary.display()))?;
        let pid = child.id().context("the engine's process id")?;
        let stdout = child.stdout.take().context("the engine's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let started = async {
            let mut metrics_addr = None;
            while let Some(line) = lines.next_line().await? {
                if let Some(addr) = line.strip_prefix("anima-wake metrics on ") {
                    metrics_addr = Some(addr.trim().parse::<SocketAddr>()?);
                }
                if let Some(addr) = line.strip_prefix("anima-wake listening on ") {
                    let grpc_addr = addr.trim().parse::<SocketAddr>()?;
                    return anyhow::Ok(Some((grpc_addr, metrics_addr)));
                }
            }
            anyhow::Ok(None)
        };
        let addrs = tokio::time::timeout(START_WAIT_MAX, started).await;
        let stderr_tail = || tail_of(&read_text(&stderr_path));
        let (grpc_addr, metrics_addr) = match addrs {
            Ok(Ok(Some((grpc, Some(metrics))))) => (grpc, metrics),
            Ok(Ok(Some((_, None)))) => bail!("the engine serves but printed no metrics address"),
            Ok(Ok(None)) => {
                let status = child.wait().await.ok();
                bail!("the engine exited before it served ({status:?}); its stderr:\n{}", stderr_tail())
            }
            Ok(Err(e)) => bail!("reading the engine's stdout: {e:#}; its stderr:\n{}", stderr_tail()),
            Err(_) => bail!("the engine did not serve within {START_WAIT_MAX:?}; its stderr:\n{}", stderr_tail()),
        };
        // Keep draining stdout so the engine never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(EngineProcess { child, pid, grpc_addr, metrics_addr, stderr_path, _dir: dir, nats })
    }

    /// The exit status if the engine stopped on its own.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The end of what the engine wrote to stderr.
    pub fn stderr_tail(&self) -> String {
        tail_of(&self.stderr_text())
    }

    /// Everything the engine wrote to stderr so far (its log lines): `anima-scale` reads its
    /// start's steps from them.
    pub fn stderr_text(&self) -> String {
        read_text(&self.stderr_path)
    }

    /// SIGTERM, then wait up to [`STOP_WAIT_MAX`]; killed after that.
    pub async fn stop(mut self) -> anyhow::Result<Stopped> {
        let started = Instant::now();
        if self.exited().is_none() {
            let sent = std::process::Command::new("kill").arg("-TERM").arg(self.pid.to_string()).status();
            if !sent.is_ok_and(|s| s.success()) {
                eprintln!("could not send SIGTERM to the engine (pid {}); killing it", self.pid);
            }
        }
        let clean = match tokio::time::timeout(STOP_WAIT_MAX, self.child.wait()).await {
            Ok(Ok(status)) => status.success(),
            Ok(Err(e)) => {
                eprintln!("waiting for the engine: {e}");
                false
            }
            Err(_) => {
                eprintln!("the engine did not stop within {STOP_WAIT_MAX:?} of SIGTERM; killing it");
                let _ = self.child.kill().await;
                false
            }
        };
        let took = started.elapsed();
        if let Some(nats) = self.nats.take() {
            nats.stop().await;
        }
        Ok(Stopped { took, clean, stderr: self.stderr_text() })
    }
}

/// How an engine stopped.
pub struct Stopped {
    /// From the SIGTERM to the exit.
    pub took: Duration,
    /// Whether the engine exited cleanly by itself.
    pub clean: bool,
    /// Its whole stderr, the lines of the stop among them.
    pub stderr: String,
}

/// The first line of the engine's log `log` that contains `marker`.
pub fn log_line<'a>(log: &'a str, marker: &str) -> Option<&'a str> {
    log.lines().find(|line| line.contains(marker))
}

/// The value of the field `name` in the log line `line` (`name=value`).
pub fn log_field<'a>(line: Option<&'a str>, name: &str) -> Option<&'a str> {
    let line = line?;
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    line[at..].split_whitespace().next()
}

/// An engine's stop: from the SIGTERM to its exit, and what the checkpoint store did to its
/// journal (its log line; only when the journal was long enough to be padded).
#[derive(Debug, Default)]
pub struct StopSteps {
    pub took: Duration,
    pub clean: bool,
    /// The runner's steps (ms): the checkpoint write in flight, the last checkpoint (and its
    /// entries), the checkpoint store's write-out.
    pub runner: Option<(f64, f64, f64, f64)>,
    pub padded: Option<Padding>,
}

/// A padding of the checkpoint store's journal, as the engine logged it.
#[derive(Debug)]
pub struct Padding {
    /// The journal before, and the padding written (MiB).
    pub journal_mib: f64,
    pub padding_mib: f64,
    pub took_ms: f64,
    /// Whether fjall replaced the journal.
    pub replaced: bool,
}

impl Padding {
    /// The padding the engine logged at `at` (`stop`, or `start` after a long journal).
    pub fn from_log(log: &str, at: &str) -> Option<Padding> {
        let at = format!(" at={at}");
        let line = log.lines().find(|line| line.contains("journal padded") && line.contains(&at));
        let number = |name: &str| log_field(line, name)?.parse::<f64>().ok();
        Some(Padding {
            journal_mib: number("journal_mib")?,
            padding_mib: number("padding_mib")?,
            took_ms: number("took_ms")?,
            replaced: log_field(line, "replaced")? == "true",
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "its checkpoint store's journal of {:.1} MiB padded with {:.1} MiB in {:.0} ms, {}",
            self.journal_mib,
            self.padding_mib,
            self.took_ms,
            if self.replaced { "replaced" } else { "NOT replaced" }
        )
    }
}

impl StopSteps {
    pub fn from(stopped: &Stopped) -> StopSteps {
        let padded = Padding::from_log(&stopped.stderr, "stop");
        let line = log_line(&stopped.stderr, "projection runner stopped");
        let number = |name: &str| log_field(line, name)?.parse::<f64>().ok();
        let runner = match (number("in_flight_ms"), number("last_ms"), number("last_entries"), number("write_out_ms")) {
            (Some(in_flight), Some(last), Some(entries), Some(write_out)) => {
                Some((in_flight, last, entries, write_out))
            }
            _ => None,
        };
        StopSteps { took: stopped.took, clean: stopped.clean, runner, padded }
    }

    pub fn describe(&self) -> String {
        let journal = self.padded.as_ref().map_or_else(
            || {
                "no journal padded (the store's journal was short or already replaced, or the line not logged)"
                    .to_owned()
            },
            Padding::describe,
        );
        let runner = self.runner.map_or_else(
            || "the runner's steps not logged".to_owned(),
            |(in_flight, last, entries, write_out)| {
                format!("checkpoint in flight {in_flight:.0} ms, last checkpoint {last:.0} ms ({entries:.0} entries), write-out {write_out:.0} ms")
            },
        );
        format!(
            "{:.3} s from SIGTERM to {}: {runner}; {journal}",
            self.took.as_secs_f64(),
            if self.clean { "a clean exit" } else { "an exit that was NOT clean" }
        )
    }
}

/// What `/metrics` says about the fold, read once.
#[derive(Clone, Copy, Debug, Default)]
pub struct FoldProbe {
    pub lag_events: u64,
    pub applied_seq: u64,
    pub last_seq: u64,
    /// The fold state's own estimate of its memory and its budget, bytes.
    pub state_estimate_bytes: u64,
    pub state_budget_bytes: u64,
    /// The engine's data dir on disk (both stores' files), bytes.
    pub data_dir_bytes: u64,
    /// The fold's reads back from the checkpoint store so far: reads, entries, seconds.
    pub cold_reads: u64,
    pub cold_read_entries: u64,
    pub cold_read_seconds: f64,
    /// The steps of the engine's start: the checkpoint store's open (seconds) and the journal
    /// it read (bytes), and the restore after it (seconds).
    pub store_open_seconds: f64,
    pub journal_read_at_open_bytes: u64,
    pub restore_seconds: f64,
}

/// One plain HTTP/1.1 `GET /metrics`, parsed for the fold's gauges.
pub async fn scrape_fold(addr: SocketAddr) -> anyhow::Result<FoldProbe> {
    let body = tokio::time::timeout(SCRAPE_WAIT_MAX, async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        anyhow::Ok(response)
    })
    .await
    .context("/metrics did not answer in time")??;
    let (head, body) = body.split_once("\r\n\r\n").context("not an HTTP response")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("/metrics answered {}", head.lines().next().unwrap_or_default());
    }
    let mut probe = FoldProbe::default();
    for line in body.lines() {
        let mut words = line.split_whitespace();
        let (Some(name), Some(value)) = (words.next(), words.next()) else { continue };
        let Ok(value) = value.parse::<f64>() else { continue };
        match name {
            "anima_cold_read_seconds_total" => probe.cold_read_seconds = value.max(0.0),
            "anima_checkpoint_store_open_seconds" => probe.store_open_seconds = value.max(0.0),
            "anima_restore_seconds" => probe.restore_seconds = value.max(0.0),
            _ => {}
        }
        let value = value.max(0.0) as u64;
        match name {
            "anima_fold_lag_events" => probe.lag_events = value,
            "anima_fold_applied_seq" => probe.applied_seq = value,
            "anima_log_last_seq" => probe.last_seq = value,
            "anima_state_estimate_bytes" => probe.state_estimate_bytes = value,
            "anima_state_budget_bytes" => probe.state_budget_bytes = value,
            "anima_data_dir_bytes" => probe.data_dir_bytes = value,
            "anima_cold_reads_total" => probe.cold_reads = value,
            "anima_cold_read_entries_total" => probe.cold_read_entries = value,
            "anima_checkpoint_journal_read_at_open_bytes" => probe.journal_read_at_open_bytes = value,
            _ => {}
        }
    }
    Ok(probe)
}

/// The resident set of a process in KiB (`VmRSS` of `/proc/<pid>/status`).
pub fn rss_kib(pid: u32) -> Option<u64> {
    budget::resident_kib(&pid.to_string())
}

/// The machine's page cache not yet written to disk: `Dirty` + `Writeback` of `/proc/meminfo`,
/// KiB.
pub fn unwritten_kib() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(budget::proc_kib_field(&meminfo, "Dirty")? + budget::proc_kib_field(&meminfo, "Writeback")?)
}

/// CPU time (user + system) a process has used, in seconds, from `/proc/<pid>/stat` ("self" for
/// this process). Assumes the usual 100 clock ticks a second (`getconf CLK_TCK`).
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    const CLOCK_TICKS_PER_SECOND: f64 = 100.0;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces; the fields after it are fixed: utime is the 14th of the
    // line, the 12th after the name.
    let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let user: f64 = fields.next()?.parse().ok()?;
    let system: f64 = fields.next()?.parse().ok()?;
    Some((user + system) / CLOCK_TICKS_PER_SECOND)
}

/// The text of the file at `path`; empty when it cannot be read.
fn read_text(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The last [`STDERR_TAIL_BYTES_MAX`] bytes of `text` (from a character's start).
fn tail_of(text: &str) -> String {
    let mut start = text.len().saturating_sub(STDERR_TAIL_BYTES_MAX);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}
