//! The fixture of the gRPC latency benchmarks (`send_decision`, `claim_start`): a gateway running
//! in-process (`anima_gateway::server::start`) on a JetStream stream of a `nats-server` started
//! for the benchmark, with one agent configured, a client channel to it, and the raw baseline
//! every one of those benchmarks is read against: one JetStream publish awaiting its ack, on the
//! same server in a stream of its own (so the baseline's messages never reach the engine's fold).

use std::time::{Duration, Instant};

use anima_engine::testing::NatsServer;
use anima_gateway::api::{self, ingest_client::IngestClient};
use anima_gateway::config::Config;
use anima_gateway::server::RunningServer;
use anima_projections::proto;
use bytes::Bytes;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

pub const AGENT: &str = "agent-bench";
pub const TEAM: &str = "T0AB12CD3";
/// The DM every human message of the fixture goes to; each one queues a `dm` wake.
pub const DM: &str = "D0BENCH01";
const HUMAN: &str = "U00000042";
/// The baseline's own stream.
const RAW_STREAM: &str = "BENCH_RAW";
const RAW_SUBJECT: &str = "bench.raw.publish";

/// A gateway on loopback JetStream and the raw baseline next to it.
pub struct LoopbackGateway {
    /// A connection to the gateway, for the benchmark's own clients.
    pub channel: Channel,
    ingest: IngestClient<Channel>,
    raw: async_nats::jetstream::Context,
    /// What the baseline publishes: about the size of the engine's request in the comparison.
    raw_payload: Bytes,
    server: RunningServer,
    messages_made: u64,
    raw_made: u64,
    _data: tempfile::TempDir,
    // Dropped last: stops nats-server.
    _nats: NatsServer,
}

/// The reply target of the fixture's DM.
pub fn dm_target() -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: TEAM.into(),
            channel_id: DM.into(),
            thread_ts: String::new(),
        })),
    }
}

impl LoopbackGateway {
    /// Starts nats-server, the gateway and the baseline's stream; `raw_payload` is what each
    /// baseline publish carries.
    pub async fn start(raw_payload: Bytes) -> LoopbackGateway {
        let nats = NatsServer::start();
        let data = tempfile::Builder::new().prefix("anima-bench-gateway-").tempdir().expect("temporary directory");
        // Written as an operator would, so fields the config gains later keep their defaults.
        let config: Config = toml::from_str(&format!(
            r#"
            listen = "127.0.0.1:0"
            data = {data:?}
            nats = {nats:?}

            [[agents]]
            id = "{AGENT}"
            slack_bot_user_id = "UBENCH001"
            slack_bot_id = "BBENCH001"
            display_name = "Bench agent"
            "#,
            data = data.path().join("engine").display().to_string(),
            nats = nats.url(),
        ))
        .expect("the benchmark's gateway config parses");
        let server = anima_gateway::server::start(config).await.expect("start the gateway");
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.local_addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect to the gateway");

        let client = async_nats::connect(nats.url()).await.expect("connect raw client");
        let raw = async_nats::jetstream::new(client);
        raw.get_or_create_stream(async_nats::jetstream::stream::Config {
            name: RAW_STREAM.into(),
            subjects: vec!["bench.raw.>".into()],
            storage: async_nats::jetstream::stream::StorageType::File,
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .expect("create the baseline stream");
        LoopbackGateway {
            ingest: IngestClient::new(channel.clone()),
            channel,
            raw,
            raw_payload,
            server,
            messages_made: 0,
            raw_made: 0,
            _data: data,
            _nats: nats,
        }
    }

    /// A human writes in the DM (journaled; queues a wake when the agent has none for it).
    pub async fn human_message(&mut self) {
        self.messages_made += 1;
        let message = api::SlackMessage {
            receiving_agent_ids: vec![AGENT.into()],
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: TEAM.into(),
            channel_id: DM.into(),
            ts: format!("1700000000.{:06}", self.messages_made),
            user_id: HUMAN.into(),
            user_name: "Person 42".into(),
            text: "can you look at the failing deploy on staging? the logs say the migration timed out".into(),
            ..Default::default()
        };
        self.ingest
            .append(api::AppendRequest {
                correlation_id: self.messages_made.to_string(),
                observation: Some(api::append_request::Observation::SlackMessage(message)),
            })
            .await
            .expect("ingest a DM message");
    }

    /// One timed JetStream publish awaiting its ack, with a `Nats-Msg-Id` like the engine's.
    pub async fn timed_publish(&mut self) -> Duration {
        self.raw_made += 1;
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("raw-{:032}", self.raw_made));
        let started = Instant::now();
        let ack = self
            .raw
            .publish_with_headers(RAW_SUBJECT, headers, self.raw_payload.clone())
            .await
            .expect("publish")
            .await
            .expect("ack");
        let elapsed = started.elapsed();
        assert!(!ack.duplicate);
        elapsed
    }

    /// Shuts the gateway down. Drop every client made from [`LoopbackGateway::channel`] first:
    /// shutdown waits for open connections.
    pub fn shutdown(self, runtime: &Runtime) {
        let LoopbackGateway { channel, ingest, server, .. } = self;
        drop((channel, ingest));
        runtime.block_on(server.shutdown()).expect("gateway shutdown");
    }
}
