//! Send decision latency over gRPC on loopback JetStream, next to the raw JetStream round trip
//! it is built on.
//!
//! On the [`LoopbackGateway`] (a gateway in-process on loopback JetStream, one agent configured)
//! a few DM messages are ingested, and a wake is claimed, started and finished so the agent has a cursor on the DM.
//! Then sequential `Sends.Send` calls to that DM are timed one by one: every fourth is preceded
//! (untimed) by a new human message, so it is held and its notice rendered; the others are
//! allowed. One `Send` is a gRPC round trip, one JetStream publish and ack, the runner's follow
//! delivering the event, the fold, and the verdict going back.
//!
//! The baseline is one JetStream publish awaiting its ack (same server, its own stream, a
//! payload the size of an encoded send request with a `Nats-Msg-Id`), timed the same way.
//! Criterion measures each on its own; the printed percentiles come from a second phase that
//! alternates one send and one publish, so both see the same machine.

use std::time::{Duration, Instant};

use anima_gateway::api::{self, sends_client::SendsClient, wakes_client::WakesClient};
use anima_projections::proto::{self, envelope::Payload};
use bytes::Bytes;
use criterion::{Criterion, SamplingMode};
use prost::Message;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

use crate::loopback_gateway::{dm_target, LoopbackGateway, AGENT};
use crate::measure::{interleave, micros, percentile, Side};

/// DM messages ingested before the first send.
const MESSAGES_BEFORE: usize = 5;
/// Every this many sends, one is preceded by a new human message and is held.
const HELD_EVERY: u64 = 4;
/// Interleaved send/publish pairs behind the printed percentiles (`--test`: a few).
const ROUNDS: usize = 1_000;
const QUICK_ROUNDS: usize = 8;

struct SendFixture {
    sends: SendsClient<Channel>,
    gateway: LoopbackGateway,
    sends_made: u64,
}

impl SendFixture {
    async fn start() -> SendFixture {
        // The baseline publishes an encoded send request.
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
                mentioned_user_ids: Vec::new(),
            })),
        };
        let mut gateway = LoopbackGateway::start(Bytes::from(request.encode_to_vec())).await;
        for _ in 0..MESSAGES_BEFORE {
            gateway.human_message().await;
        }
        // Claim, start and finish a wake so the agent has a cursor on the DM.
        let mut wakes = WakesClient::new(gateway.channel.clone());
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
        SendFixture { sends: SendsClient::new(gateway.channel.clone()), gateway, sends_made: 0 }
    }

    /// One timed `Send`, and whether it was held; a held send first gets a new message in the DM
    /// (untimed).
    async fn timed_send(&mut self) -> (Duration, bool) {
        self.sends_made += 1;
        let expect_held = self.sends_made.is_multiple_of(HELD_EVERY);
        if expect_held {
            self.gateway.human_message().await;
        }
        let request = api::SendRequest {
            agent_id: AGENT.into(),
            target: Some(dm_target()),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 512,
            mentioned_user_ids: Vec::new(),
            request_id: String::new(),
        };
        let started = Instant::now();
        let response = self.sends.send(request).await.expect("send").into_inner();
        let elapsed = started.elapsed();
        let held = matches!(response.verdict, Some(api::send_response::Verdict::Held(_)));
        assert_eq!(held, expect_held, "send {} verdict {:?}", self.sends_made, response.verdict);
        (elapsed, held)
    }
}

/// Send decisions against raw JetStream round trips. Returns the summary line, or `None` when
/// filtered out.
pub fn bench(c: &mut Criterion, runtime: &Runtime, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("send_decision");
    group.sampling_mode(SamplingMode::Flat);
    let mut fixture: Option<SendFixture> = None;
    group.bench_function("grpc_send_loopback_jetstream", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(SendFixture::start()));
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += fixture.timed_send().await.0;
                }
                total
            })
        });
    });
    group.bench_function("raw_jetstream_publish_ack", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(SendFixture::start()));
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += fixture.gateway.timed_publish().await;
                }
                total
            })
        });
    });
    group.finish();
    let mut fixture = fixture?;

    // The percentiles come from sends and publishes interleaved one by one.
    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let mut held = Vec::new();
    let mut allowed = Vec::new();
    let mut runs = interleave(rounds, |side| match side {
        Side::Engine => {
            let (elapsed, was_held) = runtime.block_on(fixture.timed_send());
            if was_held { &mut held } else { &mut allowed }.push(elapsed);
            elapsed
        }
        Side::Raw => runtime.block_on(fixture.gateway.timed_publish()),
    });
    let SendFixture { sends, gateway, .. } = fixture;
    // Close the client's connection first: shutdown waits for open connections.
    drop(sends);
    gateway.shutdown(runtime);

    for latencies in [&mut runs.engine, &mut runs.raw, &mut held, &mut allowed] {
        latencies.sort_unstable();
    }
    let p = |sorted: &[Duration], p: f64| micros(percentile(sorted, p));
    let ratio = |p: f64| percentile(&runs.engine, p).as_secs_f64() / percentile(&runs.raw, p).as_secs_f64();
    Some(format!(
        "send_decision: p50 {}, p99 {} (n={}: {} allowed p50 {} p99 {}, {} held p50 {} p99 {}), \
         raw JetStream publish+ack: p50 {}, p99 {} (n={}), ratio p50 {:.2}, p99 {:.2}",
        p(&runs.engine, 50.0),
        p(&runs.engine, 99.0),
        runs.engine.len(),
        allowed.len(),
        p(&allowed, 50.0),
        p(&allowed, 99.0),
        held.len(),
        p(&held, 50.0),
        p(&held, 99.0),
        p(&runs.raw, 50.0),
        p(&runs.raw, 99.0),
        runs.raw.len(),
        ratio(50.0),
        ratio(99.0),
    ))
}
