//! Starts the real `anima-wake` binary on a temp data dir (and, for JetStream, its own
//! `nats-server`) and gives authenticated gRPC clients. Everything is killed on drop.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anima_engine::testing::NatsServer;
use anima_gateway::api;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

pub const CONNECTOR_TOKEN: &str = "connector-token-0123456789";
pub const ADA_RUNTIME_TOKEN: &str = "runtime-ada-token-0123456789";
pub const BOB_RUNTIME_TOKEN: &str = "runtime-bob-token-0123456789";
pub const ANALYTICS_TOKEN: &str = "analytics-token-0123456789";

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

pub struct Server {
    child: Option<Child>,
    pub addr: SocketAddr,
    data: tempfile::TempDir,
    nats_url: Option<String>,
    _nats: Option<NatsServer>,
}

fn binary() -> PathBuf {
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

    fn spawn_new(nats_url: Option<String>, nats: Option<NatsServer>) -> Server {
        let data = tempfile::tempdir().expect("temp dir");
        let mut server =
            Server { child: None, addr: SocketAddr::from(([127, 0, 0, 1], 0)), data, nats_url, _nats: nats };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let config = self.data.path().join("anima.toml");
        std::fs::write(&config, CONFIG).expect("write config");
        let mut command = Command::new(binary());
        command
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .arg("--data")
            .arg(self.data.path().join("data"))
            .arg("--listen")
            .arg("127.0.0.1:0")
            .env("ANIMA_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(url) = &self.nats_url {
            command.arg("--nats").arg(url);
        }
        let mut child = command.spawn().expect("spawn anima-wake");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("anima-wake listening on ") {
                    let _ = tx.send(addr.trim().parse::<SocketAddr>().expect("address"));
                }
            }
        });
        self.addr = rx.recv_timeout(Duration::from_secs(60)).expect("anima-wake did not start listening within 60 s");
        self.child = Some(child);
    }

    /// Stops the process gracefully (SIGTERM: last checkpoint) and starts it again on the same
    /// data dir and log.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while child.try_wait().ok().flatten().is_none() && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.spawn();
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr)).expect("uri").connect().await.expect("connect")
    }

    pub async fn ingest(&self, token: &str) -> api::ingest_client::IngestClient<Authed> {
        api::ingest_client::IngestClient::with_interceptor(self.channel().await, bearer(token))
    }

    pub async fn wakes(&self, token: &str) -> api::wakes_client::WakesClient<Authed> {
        api::wakes_client::WakesClient::with_interceptor(self.channel().await, bearer(token))
    }

    pub async fn sends(&self, token: &str) -> api::sends_client::SendsClient<Authed> {
        api::sends_client::SendsClient::with_interceptor(self.channel().await, bearer(token))
    }
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
    }
}
