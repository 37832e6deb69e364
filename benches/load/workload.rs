//! The traffic: a fixed fleet of agents and surfaces, and the tasks that drive it over gRPC with
//! the gateway's own tonic clients, each at a bounded rate and with bounded calls in flight.
//!
//! * Ingest streams: `Ingest.AppendStream` with Slack DMs, Slack channel messages (some of them
//!   mentions), chat messages (p2p and group) and Linear sessions (created, then prompted).
//! * Runtime loops, one per agent: wait for a `Wakes.Watch` signal, `Claim`, `Start`, answer the
//!   wake's reply target (`Send`, resent once when held, then `Confirm`; a Linear session gets
//!   `Respond` + `ConfirmResponse`), `Finish`.
//! * Send loops: `Send` (resent when held) + `Confirm` on the agents' surfaces, as an agent that
//!   posts outside its wakes.
//! * Readers: `Analytics.Counts`, `Replay.StateAt` and `Subscriptions.List` (every page of one
//!   agent's subscriptions, page after page), each one call at a time at a low rate; a
//!   call still running when the run ends is abandoned (not counted).
//!
//! Every call is timed from just before it is made until its answer, and recorded by code when it
//! fails; nothing here panics on an engine's answer.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anima_gateway::api;
use anima_gateway::api::analytics_client::AnalyticsClient;
use anima_gateway::api::ingest_client::IngestClient;
use anima_gateway::api::replay_client::ReplayClient;
use anima_gateway::api::sends_client::SendsClient;
use anima_gateway::api::subscriptions_client::SubscriptionsClient;
use anima_gateway::api::wakes_client::WakesClient;
use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::stats::{Recorder, Rpc};

/// A unary call slower than this is given up and counted as `DeadlineExceeded`.
const CALL_WAIT_MAX: Duration = Duration::from_secs(30);
/// `AppendStream` requests one stream keeps unanswered at most; the sender waits beyond it.
const APPEND_IN_FLIGHT_MAX: usize = 512;
/// How often an ingest stream wakes up to send what its rate makes due.
const INGEST_TICK: Duration = Duration::from_millis(10);
/// An ingest stream that fell behind sends at most this much backlog (in seconds of its rate) at
/// once, so a stall is followed by a bounded burst rather than by all that was missed.
const INGEST_BACKLOG_SECONDS_MAX: f64 = 1.0;
/// How long a runtime loop waits for a `Watch` signal before it claims anyway.
const WATCH_WAIT_MAX: Duration = Duration::from_secs(1);
/// Pause before a failed stream (AppendStream, Watch) is opened again.
const REOPEN_PAUSE: Duration = Duration::from_millis(200);

const TEAM: &str = "T0LOAD001";
const TENANT: &str = "tenant-load";
const LINEAR_INSTALLATION: &str = "inst-load";
/// Every Linear event of this many is a session event; see [`Fleet::observation`].
const MIX_PERIOD: u64 = 20;

/// Message texts of realistic length (100–200 bytes); mentions are put in front.
const TEXTS: [&str; 4] = [
    "can you look at the failing deploy on staging? the logs say the migration timed out after 30 seconds",
    "the nightly export finished but three of the customer reports are empty, could you check what went wrong",
    "we are seeing elevated p99 on the checkout service since the last release; is it the new cache?",
    "please summarise the incident channel for the postmortem and list the open action items with owners",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SurfaceKind {
    SlackDm,
    SlackChannel,
    ChatP2p,
    ChatGroup,
}

#[derive(Debug)]
struct Surface {
    kind: SurfaceKind,
    /// The Slack channel id or the chat id.
    id: String,
    agent: usize,
}

#[derive(Debug)]
struct Agent {
    id: String,
    slack_bot_user_id: String,
    chat_user_id: String,
    surfaces: Vec<usize>,
}

/// The agents and surfaces of a run, and the counters that make every message id unique.
#[derive(Debug)]
pub struct Fleet {
    agents: Vec<Agent>,
    surfaces: Vec<Surface>,
    next_id: AtomicU64,
    /// Sends held at their first ask, and sends still held when resent.
    pub sends_held: AtomicU64,
    pub sends_held_twice: AtomicU64,
    /// Claims that found nothing to claim, and claims that got a wake.
    pub claims_empty: AtomicU64,
    pub claims_won: AtomicU64,
    /// `Wakes.Watch` signals received, over all agents.
    pub watch_signals: AtomicU64,
}

impl Fleet {
    /// `agents` agents; `surfaces` surfaces dealt out so every agent has each kind (Slack DM,
    /// Slack channel, chat p2p, chat group) in turn. Needs `surfaces >= 4 * agents`.
    pub fn new(agents: usize, surfaces: usize) -> Fleet {
        let mut fleet_agents: Vec<Agent> = (0..agents)
            .map(|a| Agent {
                id: format!("load-agent-{a:04}"),
                slack_bot_user_id: format!("UBOT{a:05}"),
                chat_user_id: format!("ou_bot_{a:04}"),
                surfaces: Vec::new(),
            })
            .collect();
        let kinds = [SurfaceKind::SlackDm, SurfaceKind::SlackChannel, SurfaceKind::ChatP2p, SurfaceKind::ChatGroup];
        let fleet_surfaces = (0..surfaces)
            .map(|s| {
                let kind = kinds[s % kinds.len()];
                let agent = (s / kinds.len()) % agents;
                fleet_agents[agent].surfaces.push(s);
                let id = match kind {
                    SurfaceKind::SlackDm => format!("D{s:08}"),
                    SurfaceKind::SlackChannel => format!("C{s:08}"),
                    SurfaceKind::ChatP2p | SurfaceKind::ChatGroup => format!("oc_{s:08}"),
                };
                Surface { kind, id, agent }
            })
            .collect();
        Fleet {
            agents: fleet_agents,
            surfaces: fleet_surfaces,
            next_id: AtomicU64::new(1),
            sends_held: AtomicU64::new(0),
            sends_held_twice: AtomicU64::new(0),
            claims_empty: AtomicU64::new(0),
            claims_won: AtomicU64::new(0),
            watch_signals: AtomicU64::new(0),
        }
    }

    pub fn agent_count(&self) -> usize {
        self.agents.len()
    }

    fn next(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// A Slack ts unique in the run: seconds from 2023-11-14 on, microseconds from the counter.
    fn slack_ts(n: u64) -> String {
        format!("{}.{:06}", 1_700_000_000 + n / 1_000_000, n % 1_000_000)
    }

    /// A lowercase hyphenated UUID (version 4 layout) derived from `n`.
    fn uuid(kind: u16, n: u64) -> String {
        format!("00000000-{kind:04x}-4000-8000-{n:012x}")
    }

    /// The registration of every agent, as `Ingest.Append` takes it.
    fn registrations(&self) -> impl Iterator<Item = api::AppendRequest> + '_ {
        self.agents.iter().enumerate().map(|(a, agent)| api::AppendRequest {
            correlation_id: agent.id.clone(),
            observation: Some(api::append_request::Observation::Agent(api::AgentRegistered {
                agent_id: agent.id.clone(),
                slack_bot_user_id: agent.slack_bot_user_id.clone(),
                slack_bot_id: format!("BBOT{a:05}"),
                display_name: format!("Load agent {a}"),
                chat_user_id: agent.chat_user_id.clone(),
            })),
        })
    }

    /// The `n`th observation of the mix: 35% Slack DMs, 30% Slack channel messages (a sixth of
    /// them mentions), 25% chat messages (p2p and group; a sixth of the group ones mentions),
    /// 10% Linear sessions (two created for every one prompted).
    fn observation(&self, n: u64) -> api::AppendRequest {
        let spread = anima_engine::testing::split_mix(n.wrapping_add(0x9E37_79B9_7F4A_7C15));
        let text = TEXTS[(spread % TEXTS.len() as u64) as usize];
        let slot = n % MIX_PERIOD;
        let observation = if slot < 18 {
            let wanted = match slot {
                0..7 => [SurfaceKind::SlackDm, SurfaceKind::SlackDm],
                7..13 => [SurfaceKind::SlackChannel, SurfaceKind::SlackChannel],
                _ => [SurfaceKind::ChatP2p, SurfaceKind::ChatGroup],
            }[(spread >> 8) as usize % 2];
            let surface = self.surface_of_kind(wanted, spread >> 16);
            let agent = &self.agents[surface.agent];
            let mention = (spread >> 40).is_multiple_of(6);
            let human = format!("U{:08}", (spread >> 24) % 500);
            match surface.kind {
                SurfaceKind::SlackDm | SurfaceKind::SlackChannel => {
                    let mention = mention && surface.kind == SurfaceKind::SlackChannel;
                    let text = if mention { format!("<@{}> {text}", agent.slack_bot_user_id) } else { text.to_owned() };
                    let kind =
                        if mention { api::SlackDeliveryKind::AppMention } else { api::SlackDeliveryKind::Message };
                    api::append_request::Observation::SlackMessage(api::SlackMessage {
                        receiving_agent_ids: vec![agent.id.clone()],
                        kind: kind as i32,
                        team_id: TEAM.into(),
                        channel_id: surface.id.clone(),
                        ts: Fleet::slack_ts(n),
                        user_name: format!("Person {human}"),
                        user_id: human,
                        text,
                        ..Default::default()
                    })
                }
                SurfaceKind::ChatP2p | SurfaceKind::ChatGroup => {
                    let group = surface.kind == SurfaceKind::ChatGroup;
                    let mentioned = if group && mention { vec![agent.chat_user_id.clone()] } else { Vec::new() };
                    api::append_request::Observation::ChatMessage(api::ChatMessage {
                        receiving_agent_ids: vec![agent.id.clone()],
                        tenant_id: TENANT.into(),
                        chat_id: surface.id.clone(),
                        chat_kind: (if group { api::ChatKind::Group } else { api::ChatKind::P2p }) as i32,
                        message_id: format!("om_{n:012}"),
                        sender_id: format!("ou_{human}"),
                        sender_name: format!("Person {human}"),
                        text: text.to_owned(),
                        mentioned_user_ids: mentioned,
                        ..Default::default()
                    })
                }
            }
        } else {
            // Rounds of the mix: a round ≡ 0 (mod 3) prompts the session the previous round
            // (≡ 2, a created one) made with the same slot; the others create sessions.
            let round = n / MIX_PERIOD;
            let prompted = round.is_multiple_of(3) && round > 0;
            let session_n = if prompted { n - MIX_PERIOD } else { n };
            let agent = &self.agents[(session_n / MIX_PERIOD) as usize % self.agents.len()];
            let kind =
                if prompted { api::LinearSessionEventKind::Prompted } else { api::LinearSessionEventKind::Created };
            api::append_request::Observation::LinearSession(api::LinearSession {
                receiving_agent_id: agent.id.clone(),
                installation_id: LINEAR_INSTALLATION.into(),
                kind: kind as i32,
                session_id: Fleet::uuid(1, session_n),
                agent_activity_id: if prompted { Fleet::uuid(2, n) } else { String::new() },
                issue_identifier: format!("ENG-{}", session_n % 100_000),
                issue_url: format!("https://linear.app/acme/issue/ENG-{}", session_n % 100_000),
                issue_title: "Flaky login test".into(),
                prompt_text: text.to_owned(),
                ..Default::default()
            })
        };
        api::AppendRequest { correlation_id: n.to_string(), observation: Some(observation) }
    }

    fn surface_of_kind(&self, kind: SurfaceKind, spread: u64) -> &Surface {
        // Surfaces are dealt in kind order, so every fourth one has the kind.
        let kinds = 4;
        let offset = match kind {
            SurfaceKind::SlackDm => 0,
            SurfaceKind::SlackChannel => 1,
            SurfaceKind::ChatP2p => 2,
            SurfaceKind::ChatGroup => 3,
        };
        let of_kind = (self.surfaces.len() - offset).div_ceil(kinds);
        &self.surfaces[offset + kinds * (spread as usize % of_kind)]
    }

    fn target(&self, surface: usize) -> api::ReplyTarget {
        let surface = &self.surfaces[surface];
        let target = match surface.kind {
            SurfaceKind::SlackDm | SurfaceKind::SlackChannel => api::reply_target::Target::Slack(api::SlackTarget {
                team_id: TEAM.into(),
                channel_id: surface.id.clone(),
                thread_ts: String::new(),
            }),
            SurfaceKind::ChatP2p | SurfaceKind::ChatGroup => api::reply_target::Target::Chat(api::ChatTarget {
                tenant_id: TENANT.into(),
                chat_id: surface.id.clone(),
                thread_id: String::new(),
            }),
        };
        api::ReplyTarget { target: Some(target) }
    }
}

/// Times `call` as `rpc`; `None` when it failed (recorded by code) or took longer than
/// [`CALL_WAIT_MAX`].
async fn timed<T>(
    recorder: &Recorder,
    rpc: Rpc,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Option<T> {
    let started = Instant::now();
    match tokio::time::timeout(CALL_WAIT_MAX, call).await {
        Ok(Ok(response)) => {
            recorder.ok(rpc, started.elapsed());
            Some(response.into_inner())
        }
        Ok(Err(status)) => {
            recorder.error(rpc, status.code(), status.message());
            None
        }
        Err(_) => {
            recorder.error(rpc, Code::DeadlineExceeded, "no answer within the load's 30 s call bound");
            None
        }
    }
}

/// Registers every agent through `Ingest.Append`; the load starts only when all are registered.
pub async fn register_agents(fleet: &Fleet, channel: Channel) -> anyhow::Result<()> {
    let mut ingest = IngestClient::new(channel);
    for registration in fleet.registrations() {
        let id = registration.correlation_id.clone();
        ingest.append(registration).await.map_err(|s| anyhow::anyhow!("registering agent {id}: {s}"))?;
    }
    Ok(())
}

/// One `Ingest.AppendStream` at `rate_per_second`, opened again when it fails, until `stop`.
pub async fn ingest_stream(
    fleet: Arc<Fleet>,
    channel: Channel,
    rate_per_second: f64,
    stop: CancellationToken,
    recorder: Arc<Recorder>,
) {
    let mut pacer = Pacer::new(rate_per_second);
    while !stop.is_cancelled() {
        if let Err(status) = one_append_stream(&fleet, channel.clone(), &mut pacer, &stop, &recorder).await {
            recorder.error(Rpc::AppendStream, status.code(), status.message());
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(REOPEN_PAUSE) => {}
            }
        }
    }
}

/// How many requests are due at a fixed rate since the start.
struct Pacer {
    started: Instant,
    rate_per_second: f64,
    issued: u64,
}

impl Pacer {
    fn new(rate_per_second: f64) -> Pacer {
        Pacer { started: Instant::now(), rate_per_second, issued: 0 }
    }

    fn due(&mut self) -> u64 {
        let target = (self.started.elapsed().as_secs_f64() * self.rate_per_second) as u64;
        let backlog_max = (self.rate_per_second * INGEST_BACKLOG_SECONDS_MAX).max(1.0) as u64;
        if target > self.issued + backlog_max {
            self.issued = target - backlog_max;
        }
        target - self.issued.min(target)
    }
}

async fn one_append_stream(
    fleet: &Fleet,
    channel: Channel,
    pacer: &mut Pacer,
    stop: &CancellationToken,
    recorder: &Recorder,
) -> Result<(), Status> {
    let (requests, request_stream) = mpsc::channel::<api::AppendStreamRequest>(APPEND_IN_FLIGHT_MAX);
    // The send time of every unanswered request, in order: answers come in request order. Its
    // capacity is the in-flight bound.
    let (sent_at, mut sent_at_rx) = mpsc::channel::<Instant>(APPEND_IN_FLIGHT_MAX);
    let mut client = IngestClient::new(channel);
    let mut answers = client.append_stream(ReceiverStream::new(request_stream)).await?.into_inner();
    let send = async move {
        let mut tick = tokio::time::interval(INGEST_TICK);
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            for _ in 0..pacer.due() {
                let Ok(permit) = sent_at.reserve().await else { return };
                let request = api::AppendStreamRequest { append: Some(fleet.observation(fleet.next())) };
                permit.send(Instant::now());
                if requests.send(request).await.is_err() {
                    return;
                }
                pacer.issued += 1;
            }
        }
        // Dropping `requests` ends the request stream: the server answers what it has, then ends.
    };
    let receive = async move {
        while let Some(answer) = answers.message().await? {
            let Some(sent) = sent_at_rx.recv().await else { break };
            match answer.result {
                Some(api::append_stream_response::Result::Appended(_)) => {
                    recorder.ok(Rpc::AppendStream, sent.elapsed())
                }
                Some(api::append_stream_response::Result::Error(error)) => {
                    recorder.error(Rpc::AppendStream, Code::from(error.code), &error.message)
                }
                None => recorder.error(Rpc::AppendStream, Code::Internal, "an answer with no result"),
            }
        }
        Ok::<(), Status>(())
    };
    let ((), received) = tokio::join!(send, receive);
    received
}

/// The runtime of one agent: watch, claim, start, answer, finish, at most `rate_per_second`
/// wakes a second, until `stop`.
pub async fn runtime_loop(
    fleet: Arc<Fleet>,
    agent: usize,
    channel: Channel,
    rate_per_second: f64,
    stop: CancellationToken,
    recorder: Arc<Recorder>,
) {
    let agent_id = fleet.agents[agent].id.clone();
    let worker_id = format!("worker-{agent}");
    let mut wakes = WakesClient::new(channel.clone());
    let mut sends = SendsClient::new(channel);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate_per_second.max(0.001)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let (signals, mut claimable) = tokio::sync::watch::channel(false);
    let _watching =
        AbortOnDrop(tokio::spawn(watch_signals(fleet.clone(), wakes.clone(), agent_id.clone(), signals, stop.clone())));
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        // Wait for a signal, received since the last claim, that a claim would get a wake (or
        // claim anyway after a while).
        let waited = tokio::time::timeout(WATCH_WAIT_MAX, async {
            while claimable.changed().await.is_ok() {
                if *claimable.borrow_and_update() {
                    return;
                }
            }
            // The watching task ended (the run is stopping): wait out the bound.
            std::future::pending::<()>().await
        });
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = waited => {}
        }
        claimable.mark_unchanged();
        let claim =
            api::ClaimRequest { agent_id: agent_id.clone(), worker_id: worker_id.clone(), ..Default::default() };
        let Some(claimed) = timed(&recorder, Rpc::Claim, wakes.claim(claim)).await else { continue };
        let Some(wake) = claimed.wake else {
            fleet.claims_empty.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        fleet.claims_won.fetch_add(1, Ordering::Relaxed);
        let start = api::StartRequest {
            agent_id: agent_id.clone(),
            worker_id: worker_id.clone(),
            item_id: wake.item_id.clone(),
            plan: wake.plan.clone(),
            request_id: String::new(),
        };
        let started = timed(&recorder, Rpc::Start, wakes.start(start)).await.is_some();
        if started {
            match wake.reply_to.as_ref().and_then(|t| t.target.as_ref()) {
                Some(api::reply_target::Target::Linear(session)) => {
                    respond_to_session(&mut sends, &agent_id, &session.session_id, &wake.item_id, &recorder).await
                }
                Some(_) => {
                    let target = wake.reply_to.clone().unwrap_or_default();
                    send_and_confirm(&fleet, &mut sends, &agent_id, target, &recorder).await
                }
                None => {}
            }
        }
        let outcome = if started { api::WakeOutcome::Completed } else { api::WakeOutcome::Failed };
        let finish = api::FinishRequest {
            agent_id: agent_id.clone(),
            worker_id: worker_id.clone(),
            item_id: wake.item_id,
            outcome: outcome as i32,
            reason: if started { String::new() } else { "load: start was refused".into() },
            ..Default::default()
        };
        timed(&recorder, Rpc::Finish, wakes.finish(finish)).await;
    }
}

/// Reads the agent's `Wakes.Watch` stream for as long as the run lasts, keeping only whether the
/// latest signal says a claim would get a wake; opened again when it ends or fails.
///
/// A runtime must read its Watch stream continuously, as this does, and not only between its
/// calls: signals the client has not read stay in the HTTP/2 flow-control window of the
/// connection, which every other call on that connection shares. When unread signals filled it,
/// the engine could send no answer on that connection, so every call on it waited. The earlier
/// version of this tool read one signal per claim, and every 10-minute JetStream run stalled for
/// about 25 s, ended only by the calls' 30 s deadlines.
async fn watch_signals(
    fleet: Arc<Fleet>,
    mut wakes: WakesClient<Channel>,
    agent_id: String,
    claimable: tokio::sync::watch::Sender<bool>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let opened = tokio::select! {
            _ = stop.cancelled() => return,
            opened = wakes.watch(api::WatchRequest { agent_id: agent_id.clone() }) => opened,
        };
        if let Ok(response) = opened {
            let mut stream = response.into_inner();
            loop {
                let signal = tokio::select! {
                    _ = stop.cancelled() => return,
                    signal = stream.message() => signal,
                };
                match signal {
                    Ok(Some(signal)) => {
                        fleet.watch_signals.fetch_add(1, Ordering::Relaxed);
                        claimable.send_replace(signal.claimable)
                    }
                    Ok(None) | Err(_) => break,
                };
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(REOPEN_PAUSE) => {}
        }
    }
}

/// Aborts the task when dropped, so a runtime loop's watching task ends with the loop.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// `Sends.Send` (resent once when held) and `Sends.Confirm` of the post, as a runtime does.
async fn send_and_confirm(
    fleet: &Fleet,
    sends: &mut SendsClient<Channel>,
    agent_id: &str,
    target: api::ReplyTarget,
    recorder: &Recorder,
) {
    let send = api::SendRequest {
        agent_id: agent_id.to_owned(),
        target: Some(target.clone()),
        kind: api::SendKind::Message as i32,
        draft_bytes: 120,
        request_id: String::new(),
        mentioned_user_ids: Vec::new(),
    };
    let held = |response: &api::SendResponse| matches!(response.verdict, Some(api::send_response::Verdict::Held(_)));
    let Some(first) = timed(recorder, Rpc::Send, sends.send(send.clone())).await else { return };
    if held(&first) {
        fleet.sends_held.fetch_add(1, Ordering::Relaxed);
        let Some(again) = timed(recorder, Rpc::Send, sends.send(send)).await else { return };
        if held(&again) {
            fleet.sends_held_twice.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    let n = fleet.next();
    let (ts, message_id) = match &target.target {
        Some(api::reply_target::Target::Chat(_)) => (String::new(), format!("om_own_{n:012}")),
        _ => (Fleet::slack_ts(n), String::new()),
    };
    let confirm = api::SendsConfirmRequest {
        agent_id: agent_id.to_owned(),
        target: Some(target),
        kind: api::SendKind::Message as i32,
        ts,
        message_id,
        text: "on it: the migration lock was held by the previous deploy, retrying now".into(),
        ..Default::default()
    };
    timed(recorder, Rpc::Confirm, sends.confirm(confirm)).await;
}

/// `Sends.Respond` to a Linear session wake and `Sends.ConfirmResponse` (accepted).
async fn respond_to_session(
    sends: &mut SendsClient<Channel>,
    agent_id: &str,
    session_id: &str,
    item_id: &str,
    recorder: &Recorder,
) {
    let respond = api::RespondRequest {
        agent_id: agent_id.to_owned(),
        session_id: session_id.to_owned(),
        kind: api::LinearResponseKind::Response as i32,
        body: format!("looked into it ({item_id}): the test is flaky because of a shared fixture"),
        input_ids: vec![item_id.to_owned()],
        request_id: String::new(),
    };
    let Some(responded) = timed(recorder, Rpc::Respond, sends.respond(respond)).await else { return };
    let confirm = api::ConfirmResponseRequest {
        agent_id: agent_id.to_owned(),
        activity_id: responded.activity_id,
        result: api::LinearResponseResult::Accepted as i32,
        request_id: String::new(),
    };
    timed(recorder, Rpc::ConfirmResponse, sends.confirm_response(confirm)).await;
}

/// Posts outside wakes: `Send` (+ resend when held) + `Confirm`, round robin over the agents and
/// their surfaces, at most `rate_per_second` posts a second, until `stop`.
pub async fn send_loop(
    fleet: Arc<Fleet>,
    loop_index: usize,
    loops: usize,
    channel: Channel,
    rate_per_second: f64,
    stop: CancellationToken,
    recorder: Arc<Recorder>,
) {
    let mut sends = SendsClient::new(channel);
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate_per_second.max(0.001)));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    for round in 0usize.. {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let agent = &fleet.agents[(loop_index + round * loops) % fleet.agents.len()];
        let Some(&surface) = agent.surfaces.get(round % agent.surfaces.len().max(1)) else { continue };
        let agent_id = agent.id.clone();
        send_and_confirm(&fleet, &mut sends, &agent_id, fleet.target(surface), &recorder).await;
    }
}

/// A reader's pace: one round every `period` until `stop`.
struct Rounds {
    tick: tokio::time::Interval,
    stop: CancellationToken,
}

impl Rounds {
    fn new(period: Duration, stop: CancellationToken) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Rounds { tick, stop }
    }

    /// Waits for the next round; `false` once the run is over.
    async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = self.tick.tick() => true,
        }
    }

    /// A reader's call, timed; `None` (abandoned) when the run ends first: a reader's call may
    /// take seconds on a long log.
    async fn call<T>(
        &self,
        recorder: &Recorder,
        rpc: Rpc,
        call: impl Future<Output = Result<tonic::Response<T>, Status>>,
    ) -> Option<Option<T>> {
        tokio::select! {
            _ = self.stop.cancelled() => None,
            answer = timed(recorder, rpc, call) => Some(answer),
        }
    }
}

/// `Analytics.Counts` over the whole log, one call every `period`, until `stop`.
pub async fn counts_reader(channel: Channel, period: Duration, stop: CancellationToken, recorder: Arc<Recorder>) {
    let mut analytics = AnalyticsClient::new(channel);
    let mut rounds = Rounds::new(period, stop);
    while rounds.next().await {
        let request = api::AnalyticsCountsRequest { range: None, bucket: api::AnalyticsBucket::Minute as i32 };
        if rounds.call(&recorder, Rpc::Counts, analytics.counts(request)).await.is_none() {
            return;
        }
    }
}

/// `Replay.StateAt` (newest event) of one agent after another, one call every `period`, until
/// `stop`.
pub async fn state_at_reader(
    fleet: Arc<Fleet>,
    channel: Channel,
    period: Duration,
    stop: CancellationToken,
    recorder: Arc<Recorder>,
) {
    let mut replay = ReplayClient::new(channel);
    let mut rounds = Rounds::new(period, stop);
    for round in 0usize.. {
        if !rounds.next().await {
            return;
        }
        let agent_id = fleet.agents[round % fleet.agents.len()].id.clone();
        let request = api::ReplayStateAtRequest { at: None, agent_id, surface: String::new() };
        if rounds.call(&recorder, Rpc::StateAt, replay.state_at(request)).await.is_none() {
            return;
        }
    }
}

/// Pages of `Subscriptions.List` asked for at once: the most the API answers.
const LIST_PAGE_SIZE: u32 = 1_000;

/// Every page of one agent's subscriptions after another (each page a timed call), one agent
/// every `period`, until `stop`. Every mention makes its agent follow a thread, so the pages
/// walked grow with the run.
pub async fn list_reader(
    fleet: Arc<Fleet>,
    channel: Channel,
    period: Duration,
    stop: CancellationToken,
    recorder: Arc<Recorder>,
) {
    let mut subscriptions = SubscriptionsClient::new(channel);
    let mut rounds = Rounds::new(period, stop);
    for round in 0usize.. {
        if !rounds.next().await {
            return;
        }
        let agent_id = fleet.agents[round % fleet.agents.len()].id.clone();
        let mut page_token = String::new();
        loop {
            let request =
                api::SubscriptionsListRequest { agent_id: agent_id.clone(), page_size: LIST_PAGE_SIZE, page_token };
            match rounds.call(&recorder, Rpc::List, subscriptions.list(request)).await {
                None => return,
                Some(Some(page)) if !page.next_page_token.is_empty() => page_token = page.next_page_token,
                Some(_) => break,
            }
        }
    }
}
