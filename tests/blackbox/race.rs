//! Two engine instances (two `anima-wake` processes) on one JetStream stream: foreign messages are
//! appended into a DM while the agent sends into it through both instances. Afterwards an
//! independent checker ([`audit_send_hold`]) reads the raw log — not the engine's fold — and
//! confirms that no allowed send had a foreign message between the cursor it was decided at and
//! its position in the log. The cluster failover test (`cluster_race`) runs the same checker.

use std::collections::{BTreeMap, BTreeSet};

use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{EventLog, LogError, StoredRecord};
use anima_engine::testing::{poll_until, NatsServer};
use anima_gateway::api;
use anima_projections::proto::{self as events, envelope::Payload};
use futures::StreamExt;
use prost::Message;

use crate::fixture::*;

/// The DM the race tests write into and send into, as ada.
pub const RACE_DM: &str = "D9";
/// Ada's Slack user: her own messages are not foreign to her.
const ADA_SLACK_USER: &str = "U0ADA";

/// Establishes ada's cursor in [`RACE_DM`] the way the product does: a DM wake, claimed and
/// started through `server`. Returns the seq of the start, where her cursor begins.
pub async fn start_ada_dm_wake(server: &Server) -> u64 {
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    ingest.append(slack_message(&["ada"], RACE_DM, "1700000000.000001", "", "U1", "hi")).await.expect("append");
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let wake = wakes
        .claim(api::ClaimRequest { agent_id: "ada".into(), worker_id: "w".into(), ..Default::default() })
        .await
        .expect("claim")
        .into_inner()
        .wake
        .expect("a wake");
    wakes
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: "w".into(),
            item_id: wake.item_id,
            plan: wake.plan,
            request_id: String::new(),
        })
        .await
        .expect("start")
        .into_inner()
        .started_at_seq
}

/// What the independent checker found in the raw log.
#[derive(Debug, Default)]
pub struct SendHoldAudit {
    /// Sends after the cursor's start, each compared with its own model of the DM journal.
    pub checked: usize,
    /// Seqs of sends that were allowed although a foreign row lay between their cursor and them.
    pub unsafe_sends: Vec<u64>,
    /// Seqs of sends held although no foreign row lay there (the fold and the model disagree).
    pub needlessly_held: Vec<u64>,
    /// Seqs of sends in the log that no client got an answer for.
    pub unanswered: Vec<u64>,
    /// Seqs of every message stored in the DM, by its Slack ts.
    pub message_seqs: BTreeMap<String, Vec<u64>>,
    /// Seqs of every send stored, by its event id (the request id a client retries with).
    pub send_seqs: BTreeMap<String, Vec<u64>>,
}

/// Every record of the log, from seq 1 to its last. Right after stream-leader kills a 3-node
/// cluster may still be electing (a CI run saw a consumer's creation time out): while the log
/// says it is unavailable (retry, by its contract) the checker asks again, as any client would,
/// for up to `anima_engine::testing::CLUSTER_STEP_DEADLINE`; any other error fails the test.
async fn read_whole_log(log: &JetStreamLog) -> Vec<StoredRecord> {
    poll_until("the checker's read of the whole log", || async move {
        let attempt = async {
            let last = log.last_seq().await?;
            let records: Vec<_> = log.read(1, last, None).await?.collect().await;
            Ok::<_, LogError>((last, records.into_iter().collect::<Result<Vec<_>, _>>()?))
        };
        match attempt.await {
            Ok((last, records)) => {
                assert_eq!(records.len() as u64, last, "the read ends at the last seq");
                Some(records)
            }
            Err(LogError::Unavailable(reason)) => {
                eprintln!("the checker's read of the log: unavailable ({reason}); asking again");
                None
            }
            Err(e) => panic!("the checker's read of the log: {e}"),
        }
    })
    .await
}

/// Reads the whole log at `nats_url` and replays the send-hold rule on its own model of ada's
/// [`RACE_DM`] journal: her cursor starts at the wake start at `started_at_seq`, and every send
/// (allowed or held: a held send shows the rows) moves it to the journal's end. A send is unsafe
/// when it was allowed (`verdicts`: seq → allowed, as clients were answered) with a foreign row
/// after its cursor.
pub async fn audit_send_hold(nats_url: &str, started_at_seq: u64, verdicts: &BTreeMap<u64, bool>) -> SendHoldAudit {
    let log = JetStreamLog::connect(JetStreamConfig { url: nats_url.to_owned(), ..JetStreamConfig::default() })
        .await
        .expect("connect");
    let records = read_whole_log(&log).await;
    let mut audit = SendHoldAudit::default();
    let mut rows: Vec<bool> = Vec::new(); // row ordinal - 1 → is foreign to ada
    let mut seen_ts = BTreeSet::new();
    let mut cursor: Option<usize> = None;
    for record in records {
        let envelope = events::Envelope::decode(record.payload.as_ref()).expect("decode");
        match envelope.payload {
            Some(Payload::SlackMessage(m)) if m.channel_id == RACE_DM => {
                audit.message_seqs.entry(m.ts.clone()).or_default().push(record.seq);
                // The journal has one row per message identity, however often it was delivered.
                if seen_ts.insert(m.ts.clone()) {
                    rows.push(m.user_id != ADA_SLACK_USER);
                }
            }
            Some(Payload::WakeStart(_)) if record.seq == started_at_seq => cursor = Some(rows.len()),
            Some(Payload::Send(_)) => {
                audit.send_seqs.entry(envelope.event_id.clone()).or_default().push(record.seq);
                let Some(&allowed) = verdicts.get(&record.seq) else {
                    audit.unanswered.push(record.seq);
                    continue;
                };
                if let Some(at) = cursor {
                    let foreign_between = rows[at..].iter().any(|foreign| *foreign);
                    if allowed && foreign_between {
                        audit.unsafe_sends.push(record.seq);
                    }
                    if !allowed && !foreign_between {
                        audit.needlessly_held.push(record.seq);
                    }
                    audit.checked += 1;
                }
                cursor = cursor.map(|_| rows.len());
            }
            _ => {}
        }
    }
    audit
}

const WRITERS: usize = 3;
const MESSAGES_PER_WRITER: usize = 40;
const SENDERS: usize = 4;
const SENDS_PER_SENDER: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_send_is_allowed_over_a_foreign_message_with_two_instances() {
    let nats = NatsServer::start();
    let first = Server::start_on_nats(&nats.url());
    let second = Server::start_on_nats(&nats.url());
    let dm = slack_target(RACE_DM, "");
    let started_at_seq = start_ada_dm_wake(&first).await;

    let servers = [&first, &second];
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let mut ingest = servers[writer % 2].ingest(CONNECTOR_TOKEN).await;
        tasks.push(tokio::spawn(async move {
            for n in 0..MESSAGES_PER_WRITER {
                let ts = format!("17000{writer:02}{n:03}.000100");
                ingest.append(slack_message(&["ada"], RACE_DM, &ts, "", "U7", "news")).await.expect("append");
            }
            Vec::new()
        }));
    }
    for sender in 0..SENDERS {
        let mut clients = [servers[0].sends(ADA_RUNTIME_TOKEN).await, servers[1].sends(ADA_RUNTIME_TOKEN).await];
        let dm = dm.clone();
        tasks.push(tokio::spawn(async move {
            let mut decided = Vec::new();
            for n in 0..SENDS_PER_SENDER {
                let response =
                    clients[(sender + n) % 2].send(send_request("ada", dm.clone())).await.expect("send").into_inner();
                let allowed = matches!(response.verdict, Some(api::send_response::Verdict::Allowed(_)));
                decided.push((response.decided_at_seq, allowed));
            }
            decided
        }));
    }
    let mut verdicts = BTreeMap::new();
    for task in tasks {
        for (seq, allowed) in task.await.expect("task") {
            verdicts.insert(seq, allowed);
        }
    }
    assert_eq!(verdicts.len(), SENDERS * SENDS_PER_SENDER, "every send decided at its own seq");
    let allowed = verdicts.values().filter(|a| **a).count();
    assert!(allowed > 0 && allowed < verdicts.len(), "both verdicts occur ({allowed} of {} allowed)", verdicts.len());

    let audit = audit_send_hold(&nats.url(), started_at_seq, &verdicts).await;
    assert_eq!(audit.unsafe_sends, Vec::<u64>::new(), "sends allowed over a foreign row");
    assert_eq!(audit.needlessly_held, Vec::<u64>::new(), "sends held although the log shows no foreign row");
    assert_eq!(audit.unanswered, Vec::<u64>::new(), "every send in the log was answered");
    assert_eq!(audit.checked, SENDERS * SENDS_PER_SENDER);
}

const DMS: usize = 24;
const WORKERS_PER_INSTANCE: usize = 3;

/// Many DM wakes for one agent, workers on two instances claiming, starting and finishing in
/// parallel: every wake is started exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_wake_is_started_exactly_once_with_two_instances() {
    let nats = NatsServer::start();
    let first = Server::start_on_nats(&nats.url());
    let second = Server::start_on_nats(&nats.url());
    let mut ingest = second.ingest(CONNECTOR_TOKEN).await;
    for n in 0..DMS {
        let channel = format!("D{n}");
        ingest
            .append(slack_message(&["ada"], &channel, "1700000000.000001", "", "U1", "please"))
            .await
            .expect("append");
    }
    let mut tasks = Vec::new();
    for (instance, server) in [&first, &second].into_iter().enumerate() {
        for worker in 0..WORKERS_PER_INSTANCE {
            let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
            let worker_id = format!("worker-{instance}-{worker}");
            tasks.push(tokio::spawn(async move {
                let mut started = Vec::new();
                let mut idle_rounds = 0;
                while idle_rounds < 20 {
                    let claim = api::ClaimRequest {
                        agent_id: "ada".into(),
                        worker_id: worker_id.clone(),
                        ..Default::default()
                    };
                    let wake = match wakes.claim(claim).await {
                        Ok(response) => response.into_inner().wake,
                        Err(status) if status.code() == tonic::Code::Aborted => None,
                        Err(status) => panic!("claim: {status:?}"),
                    };
                    let Some(wake) = wake else {
                        idle_rounds += 1;
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        continue;
                    };
                    idle_rounds = 0;
                    let start = api::StartRequest {
                        agent_id: "ada".into(),
                        worker_id: worker_id.clone(),
                        item_id: wake.item_id.clone(),
                        plan: wake.plan,
                        request_id: String::new(),
                    };
                    wakes.start(start).await.expect("a claimed wake starts");
                    started.push(wake.item_id.clone());
                    let finish = api::FinishRequest {
                        agent_id: "ada".into(),
                        worker_id: worker_id.clone(),
                        item_id: wake.item_id,
                        outcome: api::WakeOutcome::Completed as i32,
                        ..Default::default()
                    };
                    wakes.finish(finish).await.expect("finish");
                }
                started
            }));
        }
    }
    let mut started = Vec::new();
    for task in tasks {
        started.extend(task.await.expect("worker"));
    }
    started.sort();
    let unique: std::collections::BTreeSet<_> = started.iter().cloned().collect();
    assert_eq!(unique.len(), started.len(), "no wake started twice: {started:?}");
    assert_eq!(unique.len(), DMS, "every wake started");
}
