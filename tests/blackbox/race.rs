//! Two engine instances (two `anima-wake` processes) on one JetStream stream: foreign messages are
//! appended into a DM while the agent sends into it through both instances. Afterwards an
//! independent checker reads the raw log — not the engine's fold — and confirms that no allowed
//! send had a foreign message between the cursor it was decided at and its position in the log.

use std::collections::BTreeMap;

use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::EventLog;
use anima_engine::testing::NatsServer;
use anima_gateway::api;
use anima_projections::proto::{self as events, envelope::Payload};
use futures::StreamExt;
use prost::Message;

use crate::fixture::*;

const WRITERS: usize = 3;
const MESSAGES_PER_WRITER: usize = 40;
const SENDERS: usize = 4;
const SENDS_PER_SENDER: usize = 40;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_send_is_allowed_over_a_foreign_message_with_two_instances() {
    let nats = NatsServer::start();
    let first = Server::start_on_nats(&nats.url());
    let second = Server::start_on_nats(&nats.url());
    let dm = slack_target("D9", "");

    // Establish ada's cursor the way the product does: a DM wake, claimed and started.
    let mut ingest = first.ingest(CONNECTOR_TOKEN).await;
    ingest.append(slack_message(&["ada"], "D9", "1700000000.000001", "", "U1", "hi")).await.expect("append");
    let mut wakes = first.wakes(ADA_RUNTIME_TOKEN).await;
    let wake = wakes
        .claim(api::ClaimRequest { agent_id: "ada".into(), worker_id: "w".into(), ..Default::default() })
        .await
        .expect("claim")
        .into_inner()
        .wake
        .expect("a wake");
    let started = wakes
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: "w".into(),
            item_id: wake.item_id,
            plan: wake.plan,
            request_id: String::new(),
        })
        .await
        .expect("start")
        .into_inner();

    let servers = [&first, &second];
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let mut ingest = servers[writer % 2].ingest(CONNECTOR_TOKEN).await;
        tasks.push(tokio::spawn(async move {
            for n in 0..MESSAGES_PER_WRITER {
                let ts = format!("17000{writer:02}{n:03}.000100");
                ingest.append(slack_message(&["ada"], "D9", &ts, "", "U7", "news")).await.expect("append");
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

    // The independent checker: the raw log, decoded here, with its own model of the DM journal.
    let log = JetStreamLog::connect(JetStreamConfig { url: nats.url(), ..JetStreamConfig::default() })
        .await
        .expect("connect");
    let last = log.last_seq().await.expect("last seq");
    let records: Vec<_> = log.read(1, last, None).await.expect("read").collect().await;
    let mut rows: Vec<bool> = Vec::new(); // row ordinal - 1 → is foreign to ada
    let mut seen_ts = std::collections::BTreeSet::new();
    let mut cursor: Option<usize> = None;
    let mut checked = 0;
    for record in records {
        let record = record.expect("record");
        let envelope = events::Envelope::decode(record.payload.as_ref()).expect("decode");
        match envelope.payload {
            Some(Payload::SlackMessage(m)) if m.channel_id == "D9" && seen_ts.insert(m.ts.clone()) => {
                rows.push(m.user_id != "U0ADA");
            }
            Some(Payload::WakeStart(_)) if record.seq == started.started_at_seq => cursor = Some(rows.len()),
            Some(Payload::Send(_)) => {
                let allowed = *verdicts.get(&record.seq).expect("every send in the log was answered");
                if let Some(at) = cursor {
                    let foreign_between = rows[at..].iter().any(|foreign| *foreign);
                    assert!(!(allowed && foreign_between), "send at seq {} was allowed over a foreign row", record.seq);
                    assert_eq!(allowed, !foreign_between, "send at seq {}: verdict differs from the log", record.seq);
                    checked += 1;
                }
                cursor = cursor.map(|_| rows.len());
            }
            _ => {}
        }
    }
    assert_eq!(checked, SENDERS * SENDS_PER_SENDER);
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
