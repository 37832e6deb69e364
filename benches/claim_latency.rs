//! Claim and Start latency over gRPC on loopback JetStream, next to the raw JetStream round trip
//! they are built on.
//!
//! On the [`LoopbackGateway`] each round ingests a DM message (untimed), which queues a `dm` wake;
//! then `Wakes.Claim` is timed (append the claim request, the runner's follow delivering it, the
//! fold preparing the plan, the wake text rendered from the rows' bodies, the response), then
//! `Wakes.Start` with the claim's plan (append, fold, verdict), and the wake is finished
//! (untimed) so the next round claims a fresh one. Each is one gRPC round trip and one
//! JetStream publish and ack, so the baseline is one JetStream publish awaiting its ack (same
//! server, its own stream, a payload the size of an encoded claim request, a `Nats-Msg-Id`).
//!
//! Criterion measures Claim+Start and the baseline on their own; the printed percentiles come
//! from a second phase that alternates one round and one publish, so both see the same machine.
//! Ratios are per percentile against one publish+ack: Claim+Start is two of them in sequence.

use std::time::{Duration, Instant};

use anima_gateway::api::{self, wakes_client::WakesClient};
use anima_projections::proto::{self, envelope::Payload};
use bytes::Bytes;
use criterion::{Criterion, SamplingMode};
use prost::Message;
use tokio::runtime::Runtime;
use tonic::transport::Channel;

use crate::loopback_gateway::{LoopbackGateway, AGENT};
use crate::measure::{interleave, micros, percentile, Side};

const WORKER: &str = "worker-1";
/// Interleaved rounds behind the printed percentiles (`--test`: a few).
const ROUNDS: usize = 1_000;
const QUICK_ROUNDS: usize = 8;

/// The latencies of one round.
struct ClaimStart {
    claim: Duration,
    start: Duration,
}

struct ClaimFixture {
    wakes: WakesClient<Channel>,
    gateway: LoopbackGateway,
    rounds_made: u64,
}

impl ClaimFixture {
    async fn start() -> ClaimFixture {
        let request = proto::Envelope {
            event_id: "0190f0e2-7a4e-7b1f-9c8e-61f0c4d2aa02".into(),
            occurred_at_ms: 0,
            min_reader_version: 1,
            source: "anima-wake".into(),
            payload: Some(Payload::WakeClaim(proto::WakeClaimRequested {
                agent_id: AGENT.into(),
                worker_id: WORKER.into(),
                ..Default::default()
            })),
        };
        let gateway = LoopbackGateway::start(Bytes::from(request.encode_to_vec())).await;
        ClaimFixture { wakes: WakesClient::new(gateway.channel.clone()), gateway, rounds_made: 0 }
    }

    /// A DM message queues a wake (untimed); Claim and Start are timed; Finish is not.
    async fn timed_round(&mut self) -> ClaimStart {
        self.rounds_made += 1;
        self.gateway.human_message().await;
        let claim_request =
            api::ClaimRequest { agent_id: AGENT.into(), worker_id: WORKER.into(), ..Default::default() };
        let started = Instant::now();
        let claimed = self.wakes.claim(claim_request).await.expect("claim").into_inner();
        let claim = started.elapsed();
        let wake = claimed.wake.unwrap_or_else(|| panic!("round {}: the DM message queued no wake", self.rounds_made));
        assert_eq!(wake.reason, "dm", "round {}", self.rounds_made);
        assert!(!wake.text.is_empty());

        let start_request = api::StartRequest {
            agent_id: AGENT.into(),
            worker_id: WORKER.into(),
            item_id: wake.item_id.clone(),
            plan: wake.plan,
            request_id: String::new(),
        };
        let started = Instant::now();
        self.wakes.start(start_request).await.expect("start");
        let start = started.elapsed();

        self.wakes
            .finish(api::FinishRequest {
                agent_id: AGENT.into(),
                worker_id: WORKER.into(),
                item_id: wake.item_id,
                outcome: proto::WakeOutcome::Completed as i32,
                ..Default::default()
            })
            .await
            .expect("finish");
        ClaimStart { claim, start }
    }
}

/// Claim and Start against raw JetStream round trips. Returns the summary line, or `None` when
/// filtered out.
pub fn bench(c: &mut Criterion, runtime: &Runtime, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("claim_start");
    group.sampling_mode(SamplingMode::Flat);
    let mut fixture: Option<ClaimFixture> = None;
    group.bench_function("grpc_claim_then_start_loopback_jetstream", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(ClaimFixture::start()));
        b.iter_custom(|iters| {
            runtime.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let round = fixture.timed_round().await;
                    total += round.claim + round.start;
                }
                total
            })
        });
    });
    group.bench_function("raw_jetstream_publish_ack", |b| {
        let fixture = fixture.get_or_insert_with(|| runtime.block_on(ClaimFixture::start()));
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

    let rounds = if quick { QUICK_ROUNDS } else { ROUNDS };
    let mut claims = Vec::with_capacity(rounds);
    let mut starts = Vec::with_capacity(rounds);
    let mut runs = interleave(rounds, |side| match side {
        Side::Engine => {
            let round = runtime.block_on(fixture.timed_round());
            claims.push(round.claim);
            starts.push(round.start);
            round.claim + round.start
        }
        Side::Raw => runtime.block_on(fixture.gateway.timed_publish()),
    });
    let ClaimFixture { wakes, gateway, .. } = fixture;
    // Close the client's connection first: shutdown waits for open connections.
    drop(wakes);
    gateway.shutdown(runtime);

    for latencies in [&mut runs.engine, &mut runs.raw, &mut claims, &mut starts] {
        latencies.sort_unstable();
    }
    let raw = runs.raw.clone();
    let summary = |sorted: &[Duration]| {
        let ratio = |p: f64| percentile(sorted, p).as_secs_f64() / percentile(&raw, p).as_secs_f64();
        format!(
            "p50 {} p99 {} (ratio {:.2} / {:.2})",
            micros(percentile(sorted, 50.0)),
            micros(percentile(sorted, 99.0)),
            ratio(50.0),
            ratio(99.0)
        )
    };
    Some(format!(
        "claim_start (n={}): Claim {}, Start {}, Claim+Start {}; raw JetStream publish+ack: p50 {}, p99 {} \
         (n={}); ratios are p50 / p99 against one raw publish+ack",
        runs.engine.len(),
        summary(&claims),
        summary(&starts),
        summary(&runs.engine),
        micros(percentile(&runs.raw, 50.0)),
        micros(percentile(&runs.raw, 99.0)),
        runs.raw.len(),
    ))
}
