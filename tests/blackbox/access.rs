//! The access matrix (roles × RPCs), end to end: every RPC of every service the server has, called
//! by every kind of caller — connector, runtime scoped to ada, replay, analytics, admin, a wrong
//! token and no token — against the real binary. The expected answer of each (caller, RPC) is
//! written out below from the design, not derived from the server's own matrix; a refused call
//! must append nothing, and an allowed one must get past auth.
//!
//! The table must name every method of the served descriptor set: a service added to the API
//! fails [`the_table_covers_every_served_rpc`] until its row is written here.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anima_gateway::api;
use futures::StreamExt;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::fixture::*;

/// Who calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Caller {
    Connector,
    /// A runtime token scoped to ada.
    RuntimeAda,
    Replay,
    Analytics,
    Admin,
    WrongToken,
    NoToken,
}

impl Caller {
    const ALL: [Caller; 7] = [
        Caller::Connector,
        Caller::RuntimeAda,
        Caller::Replay,
        Caller::Analytics,
        Caller::Admin,
        Caller::WrongToken,
        Caller::NoToken,
    ];

    fn token(self) -> Option<&'static str> {
        match self {
            Caller::Connector => Some(CONNECTOR_TOKEN),
            Caller::RuntimeAda => Some(ADA_RUNTIME_TOKEN),
            Caller::Replay => Some(REPLAY_TOKEN),
            Caller::Analytics => Some(ANALYTICS_TOKEN),
            Caller::Admin => Some(ADMIN_TOKEN),
            Caller::WrongToken => Some("wrong-token-0123456789"),
            Caller::NoToken => None,
        }
    }
}

/// One RPC, or one RPC carrying something with a rule of its own (an agent registration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rpc {
    IngestAppend,
    IngestAppendRegistration,
    IngestAppendStream,
    IngestAppendStreamRegistration,
    WakesWatch,
    WakesClaim,
    WakesStart,
    WakesFinish,
    WakesHeartbeat,
    SendsSend,
    SendsConfirm,
    SendsRespond,
    SendsConfirmResponse,
    SubscriptionsMute,
    SubscriptionsUnmute,
    SubscriptionsList,
    MemoryPlan,
    MemoryStatus,
    ReplayRead,
    ReplayStateAt,
    ReplayExplain,
    AnalyticsCounts,
    AnalyticsTap,
    HealthCheck,
    ReflectionInfo,
    ReflectionInfoV1alpha,
}

impl Rpc {
    const ALL: [Rpc; 26] = [
        Rpc::IngestAppend,
        Rpc::IngestAppendRegistration,
        Rpc::IngestAppendStream,
        Rpc::IngestAppendStreamRegistration,
        Rpc::WakesWatch,
        Rpc::WakesClaim,
        Rpc::WakesStart,
        Rpc::WakesFinish,
        Rpc::WakesHeartbeat,
        Rpc::SendsSend,
        Rpc::SendsConfirm,
        Rpc::SendsRespond,
        Rpc::SendsConfirmResponse,
        Rpc::SubscriptionsMute,
        Rpc::SubscriptionsUnmute,
        Rpc::SubscriptionsList,
        Rpc::MemoryPlan,
        Rpc::MemoryStatus,
        Rpc::ReplayRead,
        Rpc::ReplayStateAt,
        Rpc::ReplayExplain,
        Rpc::AnalyticsCounts,
        Rpc::AnalyticsTap,
        Rpc::HealthCheck,
        Rpc::ReflectionInfo,
        Rpc::ReflectionInfoV1alpha,
    ];

    fn path(self) -> &'static str {
        match self {
            Rpc::IngestAppend | Rpc::IngestAppendRegistration => "/anima.v1.Ingest/Append",
            Rpc::IngestAppendStream | Rpc::IngestAppendStreamRegistration => "/anima.v1.Ingest/AppendStream",
            Rpc::WakesWatch => "/anima.v1.Wakes/Watch",
            Rpc::WakesClaim => "/anima.v1.Wakes/Claim",
            Rpc::WakesStart => "/anima.v1.Wakes/Start",
            Rpc::WakesFinish => "/anima.v1.Wakes/Finish",
            Rpc::WakesHeartbeat => "/anima.v1.Wakes/Heartbeat",
            Rpc::SendsSend => "/anima.v1.Sends/Send",
            Rpc::SendsConfirm => "/anima.v1.Sends/Confirm",
            Rpc::SendsRespond => "/anima.v1.Sends/Respond",
            Rpc::SendsConfirmResponse => "/anima.v1.Sends/ConfirmResponse",
            Rpc::SubscriptionsMute => "/anima.v1.Subscriptions/Mute",
            Rpc::SubscriptionsUnmute => "/anima.v1.Subscriptions/Unmute",
            Rpc::SubscriptionsList => "/anima.v1.Subscriptions/List",
            Rpc::MemoryPlan => "/anima.v1.Memory/Plan",
            Rpc::MemoryStatus => "/anima.v1.Memory/Status",
            Rpc::ReplayRead => "/anima.v1.Replay/Read",
            Rpc::ReplayStateAt => "/anima.v1.Replay/StateAt",
            Rpc::ReplayExplain => "/anima.v1.Replay/Explain",
            Rpc::AnalyticsCounts => "/anima.v1.Analytics/Counts",
            Rpc::AnalyticsTap => "/anima.v1.Analytics/Tap",
            Rpc::HealthCheck => "/grpc.health.v1.Health/Check",
            Rpc::ReflectionInfo => "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            Rpc::ReflectionInfoV1alpha => "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        }
    }

    fn service(self) -> &'static str {
        self.path().trim_start_matches('/').split_once('/').expect("a gRPC path").0
    }

    /// What the runtime may call, for the agents its token is scoped to: its wakes, sends and
    /// subscriptions, and its own memory-pass status (not the fleet-wide plan).
    fn runtime_may_call(self) -> bool {
        matches!(self.service(), "anima.v1.Wakes" | "anima.v1.Sends" | "anima.v1.Subscriptions")
            || self == Rpc::MemoryStatus
    }

    fn is_registration(self) -> bool {
        matches!(self, Rpc::IngestAppendRegistration | Rpc::IngestAppendStreamRegistration)
    }
}

/// What the caller must get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Unauthenticated,
    PermissionDenied,
    /// Past auth: whatever the handler answers (OK, or an error about the request itself).
    PastAuth,
}

/// The matrix, written from the design (README: roles): `agent` is the agent the request acts for.
fn expected(caller: Caller, rpc: Rpc, agent: &str) -> Expect {
    use Expect::*;
    let service = rpc.service();
    if service == "grpc.health.v1.Health" {
        // Health is open to load balancers, token or not.
        return PastAuth;
    }
    let allowed = match caller {
        Caller::WrongToken | Caller::NoToken => return Unauthenticated,
        Caller::Admin => true,
        // Reflection describes the schema; any valid token may read it.
        _ if service.starts_with("grpc.reflection.") => true,
        // Registering agents changes configuration that drives decisions: admin only.
        _ if rpc.is_registration() => false,
        Caller::Connector => service == "anima.v1.Ingest" || rpc == Rpc::SendsConfirm,
        Caller::RuntimeAda => rpc.runtime_may_call() && agent == "ada",
        // Replay tools read: the log, state as of any point, analytics, and the memory passes.
        Caller::Replay => matches!(service, "anima.v1.Replay" | "anima.v1.Analytics" | "anima.v1.Memory"),
        Caller::Analytics => service == "anima.v1.Analytics",
    };
    if allowed {
        PastAuth
    } else {
        PermissionDenied
    }
}

/// Puts the caller's token (if any) on every request.
#[derive(Clone)]
struct As(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for As {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

type Authed = tonic::service::interceptor::InterceptedService<Channel, As>;

/// Distinct Slack timestamps, so no two appends are duplicates of each other.
static NEXT_TS: AtomicU64 = AtomicU64::new(1_700_000_000);

fn fresh_ts() -> String {
    format!("{}.000100", NEXT_TS.fetch_add(1, Ordering::Relaxed))
}

fn registration() -> api::AppendRequest {
    api::AppendRequest {
        correlation_id: "register".into(),
        observation: Some(api::append_request::Observation::Agent(api::AgentRegistered {
            agent_id: "carol".into(),
            slack_bot_user_id: "U0CAROL".into(),
            slack_bot_id: "B0CAROL".into(),
            ..Default::default()
        })),
    }
}

/// The code of an answer; an answering stream is OK (its later items do not matter here).
fn code_of<T>(result: Result<T, Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

/// Calls `rpc` as `caller`, for `agent` where the request names one, with a request that would
/// change state if it were let through. Returns the gRPC code of the answer; for
/// `AppendStream`, the code of its first item when the stream itself was accepted.
async fn call(channel: &Channel, caller: Caller, rpc: Rpc, agent: &str) -> Code {
    let token = As(caller.token().map(|t| format!("Bearer {t}").parse().expect("ascii token")));
    let ingest = || api::ingest_client::IngestClient::with_interceptor(channel.clone(), token.clone());
    let wakes = || api::wakes_client::WakesClient::with_interceptor(channel.clone(), token.clone());
    let sends = || api::sends_client::SendsClient::with_interceptor(channel.clone(), token.clone());
    let subscriptions =
        || api::subscriptions_client::SubscriptionsClient::with_interceptor(channel.clone(), token.clone());
    let memory = || api::memory_client::MemoryClient::with_interceptor(channel.clone(), token.clone());
    let replay = || api::replay_client::ReplayClient::with_interceptor(channel.clone(), token.clone());
    let analytics = || api::analytics_client::AnalyticsClient::with_interceptor(channel.clone(), token.clone());
    let target = slack_target("CACCESS", "");
    let subscription = api::MuteRequest {
        agent_id: agent.into(),
        target: Some(api::SlackTarget { team_id: "T1".into(), channel_id: "CACCESS".into(), thread_ts: String::new() }),
        ..Default::default()
    };
    let unsubscription = api::UnmuteRequest {
        agent_id: subscription.agent_id.clone(),
        target: subscription.target.clone(),
        ..Default::default()
    };
    let append_stream = |request: api::AppendRequest| async move {
        let mut client: api::ingest_client::IngestClient<Authed> = ingest();
        let request = api::AppendStreamRequest { append: Some(request) };
        let mut responses = client.append_stream(tokio_stream::iter(vec![request])).await?.into_inner();
        match responses.next().await {
            Some(Ok(api::AppendStreamResponse {
                result: Some(api::append_stream_response::Result::Error(error)),
                ..
            })) => Err(Status::new(error.code.into(), error.message)),
            Some(Ok(response)) => Ok(response),
            Some(Err(status)) => Err(status),
            None => Err(Status::internal("AppendStream answered nothing")),
        }
    };
    let answer = async {
        match rpc {
            Rpc::IngestAppend => {
                code_of(ingest().append(slack_message(&["ada"], "CACCESS", &fresh_ts(), "", "U1", "hello")).await)
            }
            Rpc::IngestAppendRegistration => code_of(ingest().append(registration()).await),
            Rpc::IngestAppendStream => {
                code_of(append_stream(slack_message(&["ada"], "CACCESS", &fresh_ts(), "", "U1", "hello")).await)
            }
            Rpc::IngestAppendStreamRegistration => code_of(append_stream(registration()).await),
            Rpc::WakesWatch => code_of(wakes().watch(api::WatchRequest { agent_id: agent.into() }).await),
            Rpc::WakesClaim => code_of(
                wakes()
                    .claim(api::ClaimRequest { agent_id: agent.into(), worker_id: "w1".into(), ..Default::default() })
                    .await,
            ),
            Rpc::WakesStart => code_of(
                wakes()
                    .start(api::StartRequest {
                        agent_id: agent.into(),
                        worker_id: "w1".into(),
                        item_id: "item-1".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            Rpc::WakesFinish => code_of(
                wakes()
                    .finish(api::FinishRequest {
                        agent_id: agent.into(),
                        worker_id: "w1".into(),
                        item_id: "item-1".into(),
                        outcome: api::WakeOutcome::Completed as i32,
                        ..Default::default()
                    })
                    .await,
            ),
            Rpc::WakesHeartbeat => code_of(
                wakes()
                    .heartbeat(api::HeartbeatRequest {
                        agent_id: agent.into(),
                        worker_id: "w1".into(),
                        item_id: "item-1".into(),
                    })
                    .await,
            ),
            Rpc::SendsSend => code_of(sends().send(send_request(agent, target)).await),
            Rpc::SendsConfirm => code_of(
                sends()
                    .confirm(api::SendsConfirmRequest {
                        agent_id: agent.into(),
                        target: Some(target),
                        kind: api::SendKind::Message as i32,
                        ts: fresh_ts(),
                        text: "posted".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            Rpc::SendsRespond => code_of(
                sends()
                    .respond(api::RespondRequest {
                        agent_id: agent.into(),
                        session_id: "session-1".into(),
                        kind: api::LinearResponseKind::Thought as i32,
                        body: "thinking".into(),
                        ..Default::default()
                    })
                    .await,
            ),
            Rpc::SendsConfirmResponse => code_of(
                sends()
                    .confirm_response(api::ConfirmResponseRequest {
                        agent_id: agent.into(),
                        activity_id: "activity-1".into(),
                        result: api::LinearResponseResult::Accepted as i32,
                        ..Default::default()
                    })
                    .await,
            ),
            Rpc::SubscriptionsMute => code_of(subscriptions().mute(subscription).await),
            Rpc::SubscriptionsUnmute => code_of(subscriptions().unmute(unsubscription).await),
            Rpc::SubscriptionsList => code_of(
                subscriptions()
                    .list(api::SubscriptionsListRequest { agent_id: agent.into(), ..Default::default() })
                    .await,
            ),
            Rpc::MemoryPlan => code_of(memory().plan(api::MemoryPlanRequest::default()).await),
            Rpc::MemoryStatus => code_of(memory().status(api::MemoryStatusRequest { agent_id: agent.into() }).await),
            Rpc::ReplayRead => code_of(replay().read(api::ReplayReadRequest { limit: 1, ..Default::default() }).await),
            Rpc::ReplayStateAt => code_of(
                replay().state_at(api::ReplayStateAtRequest { agent_id: agent.into(), ..Default::default() }).await,
            ),
            Rpc::ReplayExplain => code_of(replay().explain(api::ReplayExplainRequest { seq: 1 }).await),
            Rpc::AnalyticsCounts => code_of(analytics().counts(api::AnalyticsCountsRequest::default()).await),
            Rpc::AnalyticsTap => code_of(analytics().tap(api::AnalyticsTapRequest::default()).await),
            Rpc::HealthCheck => {
                use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
                let mut health = HealthClient::with_interceptor(channel.clone(), token.clone());
                code_of(health.check(HealthCheckRequest { service: String::new() }).await)
            }
            Rpc::ReflectionInfo => {
                use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
                use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
                use tonic_reflection::pb::v1::ServerReflectionRequest;
                let mut reflection = ServerReflectionClient::with_interceptor(channel.clone(), token.clone());
                let request = ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(MessageRequest::ListServices(String::new())),
                };
                match reflection.server_reflection_info(tokio_stream::iter(vec![request])).await {
                    Ok(response) => code_of(response.into_inner().next().await.unwrap_or(Ok(Default::default()))),
                    Err(status) => status.code(),
                }
            }
            Rpc::ReflectionInfoV1alpha => {
                use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient;
                use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
                use tonic_reflection::pb::v1alpha::ServerReflectionRequest;
                let mut reflection = ServerReflectionClient::with_interceptor(channel.clone(), token.clone());
                let request = ServerReflectionRequest {
                    host: String::new(),
                    message_request: Some(MessageRequest::ListServices(String::new())),
                };
                match reflection.server_reflection_info(tokio_stream::iter(vec![request])).await {
                    Ok(response) => code_of(response.into_inner().next().await.unwrap_or(Ok(Default::default()))),
                    Err(status) => status.code(),
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), answer)
        .await
        .unwrap_or_else(|_| panic!("{caller:?} calling {rpc:?} for {agent} got no answer in 30 s"))
}

/// The log's newest sequence, read through `Replay.Read` with the admin token.
async fn last_seq(channel: &Channel) -> u64 {
    let token = As(Some(format!("Bearer {ADMIN_TOKEN}").parse().unwrap()));
    let mut replay = api::replay_client::ReplayClient::with_interceptor(channel.clone(), token);
    let mut events = replay.read(api::ReplayReadRequest::default()).await.expect("Replay.Read as admin").into_inner();
    let mut last = 0;
    while let Some(event) = events.next().await {
        last = event.expect("a stored event").seq;
    }
    last
}

/// The served `/package.Service/Method` paths: the API's descriptor set, health and reflection.
fn served_rpcs() -> BTreeSet<String> {
    let pool = prost_reflect::DescriptorPool::decode(api::DESCRIPTOR_SET).expect("the API's descriptors");
    let mut rpcs: BTreeSet<String> = pool
        .services()
        .flat_map(|service| {
            let name = service.full_name().to_owned();
            service.methods().map(move |method| format!("/{name}/{}", method.name())).collect::<Vec<_>>()
        })
        .collect();
    rpcs.insert("/grpc.health.v1.Health/Check".into());
    rpcs.insert("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo".into());
    rpcs.insert("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo".into());
    rpcs
}

#[test]
fn the_table_covers_every_served_rpc() {
    let table: BTreeSet<String> = Rpc::ALL.iter().map(|rpc| rpc.path().to_owned()).collect();
    assert_eq!(table, served_rpcs(), "add the missing RPCs to `Rpc` and to `expected`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_caller_gets_exactly_what_the_matrix_allows_and_refusals_append_nothing() {
    let server = Server::start(Backend::Embedded);
    let channel = server.channel().await;
    // Something in the log for ada: a DM that queues a wake.
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    ingest.append(slack_message(&["ada"], "DACCESS", &fresh_ts(), "", "U1", "hello ada")).await.expect("append");

    // Every refusal first: none of them may append anything. The runtime token acts for bob,
    // the agent it is not scoped to; every other caller's request names bob too.
    let before = last_seq(&channel).await;
    let mut refused = 0;
    let mut wrong = Vec::new();
    for caller in Caller::ALL {
        for rpc in Rpc::ALL {
            let want = expected(caller, rpc, "bob");
            if want == Expect::PastAuth {
                continue;
            }
            let got = call(&channel, caller, rpc, "bob").await;
            let want_code =
                if want == Expect::Unauthenticated { Code::Unauthenticated } else { Code::PermissionDenied };
            if got != want_code {
                wrong.push(format!("{caller:?} {rpc:?} for bob: got {got:?}, expected {want_code:?}"));
            }
            refused += 1;
        }
    }
    assert!(wrong.is_empty(), "{} of {refused} refusals were wrong:\n{}", wrong.len(), wrong.join("\n"));
    assert_eq!(last_seq(&channel).await, before, "a refused call appended something");
    assert!(refused > 100, "the matrix refuses {refused} (caller, RPC) pairs");

    // Then everything the matrix allows gets past auth (the runtime token acting for ada).
    for caller in Caller::ALL {
        for rpc in Rpc::ALL {
            let agent = if caller == Caller::RuntimeAda { "ada" } else { "bob" };
            if expected(caller, rpc, agent) != Expect::PastAuth {
                continue;
            }
            let got = call(&channel, caller, rpc, agent).await;
            if matches!(got, Code::Unauthenticated | Code::PermissionDenied) {
                wrong.push(format!("{caller:?} {rpc:?} for {agent}: got {got:?}, expected to get past auth"));
            }
        }
    }
    assert!(wrong.is_empty(), "allowed calls were refused:\n{}", wrong.join("\n"));
    // The admin's registration went through: carol is an agent now.
    assert!(last_seq(&channel).await > before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_auth_scheme_is_case_insensitive_and_other_schemes_are_refused() {
    // Given a server with tokens,
    let server = Server::start(Backend::Embedded);
    let channel = server.channel().await;
    let plan = |scheme: &str| {
        let token = As(Some(format!("{scheme} {ADMIN_TOKEN}").parse().expect("a header value")));
        let mut memory = api::memory_client::MemoryClient::with_interceptor(channel.clone(), token);
        async move { code_of(memory.plan(api::MemoryPlanRequest::default()).await) }
    };
    // when a client spells the scheme in any case, the token is accepted (RFC 9110 §11.1);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        assert_eq!(plan(scheme).await, Code::Ok, "scheme {scheme:?}");
    }
    // another scheme is not a bearer token.
    assert_eq!(plan("Basic").await, Code::Unauthenticated);
}
