//! Starts the real `anima-wake` binary on a temp data dir (and, for JetStream, its own
//! `nats-server`) and gives authenticated gRPC clients. Everything is killed on drop.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anima_engine::testing::NatsServer;
use anima_gateway::api;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, ClientTlsConfig};

pub const CONNECTOR_TOKEN: &str = "connector-token-0123456789";
pub const ADA_RUNTIME_TOKEN: &str = "runtime-ada-token-0123456789";
pub const BOB_RUNTIME_TOKEN: &str = "runtime-bob-token-0123456789";
pub const ANALYTICS_TOKEN: &str = "analytics-token-0123456789";
pub const REPLAY_TOKEN: &str = "replay-token-0123456789";
pub const ADMIN_TOKEN: &str = "admin-token-0123456789";

/// Tokens and agents every black-box server starts with.
pub const CONFIG: &str = r#"
[[tokens]]
name = "connector"
token = "connector-token-0123456789"
role = "connector"

[[tokens]]
name = "runtime-ada"
token = "runtime-ada-token-0123456789"
role = "runtime"
agents = ["ada"]

[[tokens]]
name = "runtime-bob"
token = "runtime-bob-token-0123456789"
role = "runtime"
agents = ["bob"]

[[tokens]]
name = "analytics"
token = "analytics-token-0123456789"
role = "analytics"

[[tokens]]
name = "replay"
token = "replay-token-0123456789"
role = "replay"

[[tokens]]
name = "admin"
token = "admin-token-0123456789"
role = "admin"

[[agents]]
id = "ada"
slack_bot_user_id = "U0ADA"
slack_bot_id = "B0ADA"
chat_user_id = "ou_ada"

[[agents]]
id = "bob"
slack_bot_user_id = "U0BOB"
slack_bot_id = "B0BOB"
chat_user_id = "ou_bob"

[runner]
checkpoint_every_events = 50
checkpoint_interval_ms = 200
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Embedded,
    JetStream,
}

/// What a test changes about the server it starts.
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    /// Top-level TOML keys put before [`CONFIG`] (e.g. `tls_cert = "..."`).
    pub config_prefix: String,
    /// More `serve` flags.
    pub args: Vec<OsString>,
    /// The CA (PEM) that signed the server's certificate: clients connect over TLS with it.
    pub tls_ca_pem: Option<String>,
    /// The body of the `[memoryCoherence]` table. `None`: no memory-pass scheduler
    /// (`tickSeconds = 0`), so passes never mix into the wakes other tests claim.
    pub memory_coherence: Option<String>,
    /// More TOML tables, put after everything else (e.g. a `[doNotContact]` table).
    pub tables: String,
}

pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
    /// Where `/metrics` is served, when started with `--metrics-listen`.
    pub metrics_addr: Option<SocketAddr>,
    options: ServerOptions,
    data: tempfile::TempDir,
    nats_url: Option<String>,
    _nats: Option<NatsServer>,
}

pub fn binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(|p| p.parent()).expect("target dir");
    let binary = dir.join(format!("anima-wake{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.exists(),
        "{} is missing: run `cargo build --workspace --bins` before the tests (the README's test command does)",
        binary.display()
    );
    binary
}

impl Server {
    /// A server on its own log: a temp embedded log, or its own `nats-server`.
    pub fn start(backend: Backend) -> Server {
        let nats = (backend == Backend::JetStream).then(NatsServer::start);
        let url = nats.as_ref().map(|n| n.url());
        Server::spawn_new(url, nats)
    }

    /// Another engine instance on the JetStream stream at `nats_url`, with its own data dir.
    pub fn start_on_nats(nats_url: &str) -> Server {
        Server::spawn_new(Some(nats_url.to_owned()), None)
    }

    /// Another engine instance on the JetStream stream at `nats_url` (one URL, or a cluster's
    /// comma-separated list, as `--nats` takes it), started with `options`.
    pub fn start_on_nats_with(nats_url: &str, options: ServerOptions) -> Server {
        Server::spawn_with(Some(nats_url.to_owned()), None, options)
    }

    /// A server on its own embedded log, started with `options`.
    pub fn start_with(options: ServerOptions) -> Server {
        Server::spawn_with(None, None, options)
    }

    /// A server on its own log (a temp embedded log, or its own `nats-server`), started with
    /// `options`.
    pub fn start_on(backend: Backend, options: ServerOptions) -> Server {
        let nats = (backend == Backend::JetStream).then(NatsServer::start);
        let url = nats.as_ref().map(|n| n.url());
        Server::spawn_with(url, nats, options)
    }

    fn spawn_new(nats_url: Option<String>, nats: Option<NatsServer>) -> Server {
        Server::spawn_with(nats_url, nats, ServerOptions::default())
    }

    fn spawn_with(nats_url: Option<String>, nats: Option<NatsServer>, options: ServerOptions) -> Server {
        let data = tempfile::tempdir().expect("temp dir");
        let mut server = Server {
            child: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics_addr: None,
            options,
            data,
            nats_url,
            _nats: nats,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let config = self.data.path().join("anima.toml");
        let memory = self.options.memory_coherence.as_deref().unwrap_or("tickSeconds = 0");
        let text =
            format!("{}\n{CONFIG}\n[memoryCoherence]\n{memory}\n{}\n", self.options.config_prefix, self.options.tables);
        std::fs::write(&config, text).expect("write config");
        let mut command = Command::new(binary());
        command
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--data")
            .arg(self.data.path().join("data"))
            .env("ANIMA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(url) = &self.nats_url {
            command.arg("--nats").arg(url);
        }
        if !self.options.args.iter().any(|a| a == "--listen") {
            command.arg("--listen").arg("127.0.0.1:0");
        }
        command.args(&self.options.args);
        let mut child = command.spawn().expect("spawn anima-wake");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            // The metrics line, when there is one, comes before the listening line.
            let mut metrics_addr = None;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("anima-wake metrics on ") {
                    metrics_addr = Some(addr.trim().parse::<SocketAddr>().expect("metrics address"));
                }
                if let Some(addr) = line.strip_prefix("anima-wake listening on ") {
                    let _ = tx.send((addr.trim().parse::<SocketAddr>().expect("address"), metrics_addr));
                }
            }
        });
        (self.addr, self.metrics_addr) =
            rx.recv_timeout(Duration::from_secs(60)).expect("anima-wake did not start listening within 60 s");
        // Bound to every address (a non-loopback test): clients come in over loopback.
        if self.addr.ip().is_unspecified() {
            self.addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        self.child = Some(child);
    }

    /// Stops the process gracefully (SIGTERM: last checkpoint) and starts it again on the same
    /// data dir and log.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Stops the process gracefully (SIGTERM: last checkpoint), waiting up to 30 s for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The NATS URL of a JetStream server.
    pub fn nats_url(&self) -> Option<&str> {
        self.nats_url.as_deref()
    }

    /// The server's data dir (its embedded log, if used, and its checkpoints).
    pub fn data_dir(&self) -> PathBuf {
        self.data.path().join("data")
    }

    /// `anima-wake` with `args`, run to completion: (success, stdout, stderr).
    pub fn run_tool(args: &[&str]) -> (bool, String, String) {
        let output = Command::new(binary()).args(args).env("ANIMA_LOG", "warn").output().expect("run anima-wake");
        (
            output.status.success(),
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    }

    /// A connection to the gRPC port: over TLS, trusting the test CA, when the server has a
    /// certificate; plain text otherwise.
    pub async fn channel(&self) -> Channel {
        match &self.options.tls_ca_pem {
            Some(ca) => {
                let tls = ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                    .domain_name("localhost");
                Channel::from_shared(format!("https://{}", self.addr))
                    .expect("uri")
                    .tls_config(tls)
                    .expect("client TLS config")
                    .connect()
                    .await
                    .expect("connect over TLS")
            }
            None => {
                Channel::from_shared(format!("http://{}", self.addr)).expect("uri").connect().await.expect("connect")
            }
        }
    }

    /// The text `GET /metrics` answers, read over plain HTTP/1.1.
    pub async fn scrape_metrics(&self) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.metrics_addr.expect("started with --metrics-listen");
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect to the metrics listener");
        let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.expect("write the request");
        let mut response = String::new();
        tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut response))
            .await
            .expect("metrics answered within 10 s")
            .expect("read the response");
        let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        assert!(head.to_lowercase().contains("content-type: application/openmetrics-text"), "{head}");
        body.to_owned()
    }

    pub async fn ingest(&self, token: &str) -> api::ingest_client::IngestClient<Authed> {
        api::ingest_client::IngestClient::with_interceptor(self.channel().await, bearer(token))
    }

    pub async fn wakes(&self, token: &str) -> api::wakes_client::WakesClient<Authed> {
        api::wakes_client::WakesClient::with_interceptor(self.channel().await, bearer(token))
    }

    pub async fn memory(&self, token: &str) -> api::memory_client::MemoryClient<Authed> {
        api::memory_client::MemoryClient::with_interceptor(self.channel().await, bearer(token))
    }

    pub async fn sends(&self, token: &str) -> api::sends_client::SendsClient<Authed> {
        api::sends_client::SendsClient::with_interceptor(self.channel().await, bearer(token))
    }
}

/// Runs `anima-wake serve` with `config` (the whole file) and `args`, expecting start-up to be
/// refused: returns what it wrote to stderr once it exited with a failure.
pub fn serve_refused(config: &str, args: &[&str]) -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("anima.toml");
    std::fs::write(&path, config).expect("write config");
    let mut child = Command::new(binary())
        .arg("serve")
        .arg("--config")
        .arg(&path)
        .arg("--data")
        .arg(dir.path().join("data"))
        .args(args)
        .env("ANIMA_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn anima-wake");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for anima-wake") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("anima-wake did not refuse to start within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut stderr).expect("read stderr");
    assert!(!status.success(), "anima-wake started with {config:?}: {stderr}");
    stderr
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub type Authed = tonic::service::interceptor::InterceptedService<Channel, BearerToken>;

#[derive(Clone)]
pub struct BearerToken(MetadataValue<tonic::metadata::Ascii>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        request.metadata_mut().insert("authorization", self.0.clone());
        Ok(request)
    }
}

pub fn bearer(token: &str) -> BearerToken {
    BearerToken(format!("Bearer {token}").parse().expect("ascii token"))
}

/// A Slack message observation for `receivers`.
pub fn slack_message(
    receivers: &[&str],
    channel: &str,
    ts: &str,
    thread_ts: &str,
    user: &str,
    text: &str,
) -> api::AppendRequest {
    api::AppendRequest {
        correlation_id: ts.to_owned(),
        observation: Some(api::append_request::Observation::SlackMessage(api::SlackMessage {
            receiving_agent_ids: receivers.iter().map(|r| r.to_string()).collect(),
            kind: api::SlackDeliveryKind::Message as i32,
            team_id: "T1".into(),
            channel_id: channel.into(),
            ts: ts.into(),
            thread_ts: thread_ts.into(),
            user_id: user.into(),
            text: text.into(),
            user_name: format!("Person {user}"),
            ..Default::default()
        })),
    }
}

pub fn slack_target(channel: &str, thread_ts: &str) -> api::ReplyTarget {
    api::ReplyTarget {
        target: Some(api::reply_target::Target::Slack(api::SlackTarget {
            team_id: "T1".into(),
            channel_id: channel.into(),
            thread_ts: thread_ts.into(),
        })),
    }
}

pub fn send_request(agent: &str, target: api::ReplyTarget) -> api::SendRequest {
    api::SendRequest {
        agent_id: agent.into(),
        target: Some(target),
        kind: api::SendKind::Message as i32,
        draft_bytes: 42,
        request_id: String::new(),
        mentioned_user_ids: Vec::new(),
    }
}

/// The next `Wakes.Watch` signal, within 10 s.
pub async fn next_signal(watch: &mut tonic::Streaming<api::WatchResponse>) -> api::WatchResponse {
    use futures::StreamExt;
    tokio::time::timeout(std::time::Duration::from_secs(10), watch.next())
        .await
        .expect("a signal within 10 s")
        .expect("signal")
        .expect("ok")
}

/// Claims the agent's oldest claimable wake (reporting `memory_md_bytes` for a memory pass) and
/// starts it with the plan the claim gave.
pub async fn claim_and_start(
    wakes: &mut api::wakes_client::WakesClient<Authed>,
    agent: &str,
    worker: &str,
    memory_md_bytes: u64,
) -> api::Wake {
    let wake = wakes
        .claim(api::ClaimRequest {
            agent_id: agent.into(),
            worker_id: worker.into(),
            memory_md_bytes,
            ..Default::default()
        })
        .await
        .expect("claim")
        .into_inner()
        .wake
        .expect("a wake to claim");
    wakes
        .start(api::StartRequest {
            agent_id: agent.into(),
            worker_id: worker.into(),
            item_id: wake.item_id.clone(),
            plan: wake.plan.clone(),
            request_id: String::new(),
        })
        .await
        .expect("start");
    wake
}
