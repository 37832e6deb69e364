//! Send decision latency over gRPC on loopback JetStream, next to the raw JetStream round trip
//! it is built on.
//!
//! A gateway runs in-process (`anima_gateway::server::start`) on a JetStream stream of a
//! `nats-server` started for the benchmark. One agent is configured; a few DM messages are
//! ingested, and a wake is claimed, started and finished so the agent has a cursor on the DM.
//! Then sequential `Sends.Send` calls to that DM are timed one by one: every fourth is preceded
//! (untimed) by a new human message, so it is held and its notice rendered; the others are
//! allowed. One `Send` is a gRPC round trip, one JetStream publish and ack, the runner's follow
//! delivering the event, the fold, and the verdict going back.
//!
//! The baseline is one JetStream publish awaiting its ack (same server, its own stream, a
//! payload the size of an encoded send request with a `Nats-Msg-Id`), timed the same way.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anima_engine::testing::NatsServer;
use anima_gateway::api::{
    self, ingest_client::IngestClient, sends_client::SendsClient, wakes_client::WakesClient,
};
use anima_gateway::config::{AgentConfig, Config};
use anima_gateway::server::RunningServer;
use anima_projections::proto::{self, envelope::Payload};
use bytes::Bytes;
use criterion::{Criterion, SamplingMode};
use prost::Message;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

use crate::measure::{micros, percentile, Tally};

const AGENT: &str = "agent-bench";
const TEAM: &str = "T0AB12CD3";
const DM: &str = "D0BENCH01";
const HUMAN: &str = "U00000042";
/// DM messages ingested before the first send.
const MESSAGES_BEFORE: usize = 5;
/// Every this many sends, one is preceded by a new human message and is held.
const HELD_EVERY: u64 = 4;
/// The baseline's own stream, so its publishes never reach the engine's fold.
const RAW_STREAM: &str = "BENCH_RAW";
const RAW_SUBJECT: &str = "bench.raw.send";

struct SendFixture {
    sends: SendsClient<Channel>,
    ingest: IngestClient<Channel>,
    raw: async_nats::jetstream::Context,
    raw_payload: Bytes,
    server: RunningServer,
    sends_made: u64,
    messages_made: u64,
    held: u64,
    raw_made: u64,
    _data: tempfile::TempDir,
    // Dropped last: stops nats-server.
    _nats: NatsServer,
}

fn dm_target() -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: TEAM.into(),
            channel_id: DM.into(),
            thread_ts: String::new(),
        })),
    }
}

impl SendFixture {
    async fn start() -> SendFixture {
        let nats = NatsServer::start();
        let data = tempfile::Builder::new().prefix("anima-bench-gateway-").tempdir().expect("temporary directory");
        let mut config = Config::default();
        config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.data = data.path().join("engine");
        config.nats = Some(nats.url());
        config.agents = vec![AgentConfig {
            id: AGENT.into(),
            slack_bot_user_id: "UBENCH001".into(),
            slack_bot_id: "BBENCH001".into(),
            display_name: "Bench agent".into(),
        }];
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
        let request = proto::Envelope {
            event_id: "0190f0e2-7a4e-7b1f-9c8e-61f0c4d2aa01".into(),
            occurred_at_ms: 0,
            min_reader_version: 1,
            source: "anima-wake".into(),
            payload: Some(Payload::Send(proto::SendRequested {
                agent_id: AGENT.into(),
                target: Some(dm_target()),
                kind: proto::SendKind::Message as i32,
                draft_bytes: 512,
            })),
        };

        let mut fixture = SendFixture {
            sends: SendsClient::new(channel.clone()),
            ingest: IngestClient::new(channel.clone()),
            raw,
            raw_payload: Bytes::from(request.encode_to_vec()),
            server,
            sends_made: 0,
            messages_made: 0,
            held: 0,
            raw_made: 0,
            _data: data,
            _nats: nats,
        };
        for _ in 0..MESSAGES_BEFORE {
            fixture.human_message().await;
        }
        // Claim, start and finish a wake so the agent has a cursor on the DM.
        let mut wakes = WakesClient::new(channel);
        let wake = wakes
            .claim(api::ClaimRequest { agent_id: AGENT.into(), worker_id: "worker-1".into(), ..Default::default() })
            .await
            .expect("claim")
            .into_inner()
            .wake
            .expect("a DM message queued a wake");
        wakes
            .start(api::StartRequest {
                agent_id: AGENT.into(),
                worker_id: "worker-1".into(),
                item_id: wake.item_id.clone(),
                plan: wake.plan,
                ..Default::default()
            })
            .await
            .expect("start");
        wakes
            .finish(api::FinishRequest {
                agent_id: AGENT.into(),
                worker_id: "worker-1".into(),
                item_id: wake.item_id,
                outcome: proto::WakeOutcome::Completed as i32,
                ..Default::default()
            })
            .await
            .expect("finish");
        fixture
    }

    /// A human writes in the DM.
    async fn human_message(&mut self) {
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

    /// One timed `Send`; a held send first gets a new message in the DM (untimed).
    async fn timed_send(&mut self) -> Duration {
        self.sends_made += 1;
        let expect_held = self.sends_made % HELD_EVERY == 0;
        if expect_held {
            self.human_message().await;
        }
        let request = api::SendRequest {
            agent_id: AGENT.into(),
            target: Some(dm_target()),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 512,
            request_id: String::new(),
        };
        let started = Instant::now();
        let response = self.sends.send(request).await.expect("send").into_inner();
        let elapsed = started.elapsed();
        let held = matches!(response.verdict, Some(api::send_response::Verdict::Held(_)));
        assert_eq!(held, expect_held, "send {} verdict {:?}", self.sends_made, response.verdict);
        self.held += u64::from(held);
        elapsed
    }

    /// One timed JetStream publish awaiting its ack.
    async fn timed_publish(&mut self) -> Duration {
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
}

/// Records `latencies` and returns their sum, criterion's measured time.
fn record(tally: &mut Tally, latencies: Vec<Duration>) -> Duration {
    let total = latencies.iter().sum();
    tally.record_latencies(latencies);
    total
}

/// Send decisions against raw JetStream round trips. Returns the summary line.
pub fn bench(c: &mut Criterion, runtime: &Runtime) -> Option<String> {
    let mut group = c.benchmark_group("send_decision");
    group.sampling_mode(SamplingMode::Flat);
    let mut fixture: Option<SendFixture> = None;
    let mut sends = Tally::default();
    group.bench_function("grpc_send_loopback_jetstream", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(SendFixture::start()));
        b.iter_custom(|iters| {
            let latencies = runtime.block_on(async {
                let mut latencies = Vec::with_capacity(iters as usize);
                for _ in 0..iters {
                    latencies.push(fixture.timed_send().await);
                }
                latencies
            });
            record(&mut sends, latencies)
        });
    });
    let mut publishes = Tally::default();
    group.bench_function("raw_jetstream_publish_ack", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(SendFixture::start()));
        b.iter_custom(|iters| {
            let latencies = runtime.block_on(async {
                let mut latencies = Vec::with_capacity(iters as usize);
                for _ in 0..iters {
                    latencies.push(fixture.timed_publish().await);
                }
                latencies
            });
            record(&mut publishes, latencies)
        });
    });
    group.finish();
    let held = fixture.as_ref().map_or(0, |f| f.held);
    if let Some(fixture) = fixture {
        let SendFixture { sends, ingest, server, .. } = fixture;
        // Close the client's connection first: shutdown waits for open connections.
        drop((sends, ingest));
        runtime.block_on(server.shutdown()).expect("gateway shutdown");
    }

    let (sends, publishes) = (sends.latencies_sorted(), publishes.latencies_sorted());
    if sends.is_empty() || publishes.is_empty() {
        return None;
    }
    let (send_p50, send_p99) = (percentile(&sends, 50.0), percentile(&sends, 99.0));
    let (raw_p50, raw_p99) = (percentile(&publishes, 50.0), percentile(&publishes, 99.0));
    Some(format!(
        "send_decision: p50 {}, p99 {} (n={}, every {HELD_EVERY}th held; {held} held over the whole run), \
         raw JetStream publish+ack: p50 {}, p99 {} (n={}), ratio p50 {:.2}, p99 {:.2}",
        micros(send_p50),
        micros(send_p99),
        sends.len(),
        micros(raw_p50),
        micros(raw_p99),
        publishes.len(),
        send_p50.as_secs_f64() / raw_p50.as_secs_f64(),
        send_p99.as_secs_f64() / raw_p99.as_secs_f64(),
    ))
}
