//! Subjects as NATS users see them: a configurable prefix lets two deployments share one server,
//! a new stream keeps ids such as `ada_bot` readable, and a stream created before the encoding was
//! recorded keeps the first encoding, so its old and new events of one surface still share a
//! subject.

use std::time::Duration;

use anima_engine::command::{ChatObservation, SlackObservation};
use anima_engine::instance::{Backend, Instance, InstanceConfig, InstanceError};
use anima_engine::log::jetstream::{JetStreamConfig, SUBJECT_ENCODING_METADATA_KEY};
use anima_engine::log::{EventLog, LogError, StoredRecord};
use anima_engine::replay::{EventFilter, ReadQuery, ReplayConfig, Replayer};
use anima_engine::subject::{SubjectEncoding, SubjectPrefix};
use anima_engine::testing::NatsServer;
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::redact::Redactor;
use anima_projections::surface::SurfaceId;
use futures::{StreamExt, TryStreamExt};
use prost::Message;

const WAIT: Duration = Duration::from_secs(10);

fn jetstream(server: &NatsServer, stream: &str, prefix: &str) -> JetStreamConfig {
    JetStreamConfig {
        url: server.url(),
        stream: stream.into(),
        subject_prefix: SubjectPrefix::new(prefix).expect("a valid prefix"),
        ..JetStreamConfig::default()
    }
}

async fn start(config: JetStreamConfig) -> Result<(Instance, tempfile::TempDir), InstanceError> {
    let dir = tempfile::tempdir().expect("tempdir");
    let instance = Instance::start(InstanceConfig::new(dir.path(), Backend::JetStream(config))).await?;
    Ok((instance, dir))
}

fn registration(agent: &str) -> proto::AgentRegistered {
    proto::AgentRegistered { agent_id: agent.into(), slack_bot_user_id: "UBOT".into(), ..Default::default() }
}

fn dm(agent: &str, team: &str, ts: &str) -> SlackObservation {
    SlackObservation {
        receiving_agent_ids: vec![agent.into()],
        message: proto::SlackMessageObserved {
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: team.into(),
            channel_id: "D1".into(),
            ts: ts.into(),
            user_id: "UPERSON".into(),
            text: "hello".into(),
            ..Default::default()
        },
        occurred_at_ms: 0,
    }
}

/// A one-to-one chat message to `agent` in the Lark-style chat `oc_abc`, whose id holds a `_`.
fn chat_dm(agent: &str, message_id: &str) -> ChatObservation {
    ChatObservation {
        receiving_agent_ids: vec![agent.into()],
        message: proto::ChatMessageObserved {
            receiving_agent_id: agent.into(),
            tenant_id: "t1".into(),
            chat_id: "oc_abc".into(),
            chat_kind: proto::ChatKind::P2p as i32,
            message_id: message_id.into(),
            sender_id: "ou_person".into(),
            sender_name: "someone".into(),
            text: "hello".into(),
            ..Default::default()
        },
        occurred_at_ms: 0,
    }
}

fn chat_surface() -> SurfaceId {
    SurfaceId::Chat { tenant: "t1".into(), chat: "oc_abc".into(), thread: None }
}

async fn everything(log: &dyn EventLog) -> Vec<StoredRecord> {
    let records = log.read(1, u64::MAX, None).await.expect("read");
    tokio::time::timeout(WAIT, records.try_collect()).await.expect("the read ends").expect("read")
}

/// The agent ids every stored event of `records` names.
fn agents_named(records: &[StoredRecord]) -> Vec<String> {
    let redactor = Redactor::schema();
    let mut agents: Vec<String> = ["ada_bot", "bob"]
        .into_iter()
        .filter(|agent| {
            records.iter().any(|r| redactor.redact(r.seq, r.timestamp_ns, &r.subject, &r.payload).names_agent(agent))
        })
        .map(str::to_owned)
        .collect();
    agents.sort();
    agents
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_share_one_server_under_their_own_streams_and_prefixes() {
    let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
    let (first, _first_dir) = start(jetstream(&server, "ANIMA", "anima.v1")).await.expect("the first deployment");
    let (second, _second_dir) =
        start(jetstream(&server, "ACME", "acme.anima")).await.expect("a second deployment beside it");

    for (instance, agent) in [(&first, "ada_bot"), (&second, "bob")] {
        instance.engine.register_agent(registration(agent)).await.expect("register");
        instance.engine.ingest_slack(dm(agent, "T1", "1700000001.000100")).await.expect("ingest");
    }
    first.engine.ingest_chat(chat_dm("ada_bot", "m1")).await.expect("ingest chat");

    let first_events = everything(first.engine.log().as_ref()).await;
    let second_events = everything(second.engine.log().as_ref()).await;
    assert!(first_events.iter().all(|r| r.subject.starts_with("anima.v1.")), "{first_events:#?}");
    assert!(second_events.iter().all(|r| r.subject.starts_with("acme.anima.")), "{second_events:#?}");
    assert_eq!(agents_named(&first_events), ["ada_bot"], "the first stream holds only its own events");
    assert_eq!(agents_named(&second_events), ["bob"], "the second stream holds only its own events");
    // New streams keep ids readable in their subjects.
    let subjects: Vec<&str> = first_events.iter().map(|r| r.subject.as_str()).collect();
    assert!(subjects.contains(&"anima.v1.agent.ada_bot"), "{subjects:?}");
    assert!(subjects.contains(&"anima.v1.surface.slack.T1.D1"), "{subjects:?}");
    assert!(subjects.contains(&"anima.v1.surface.chat.t1.oc_abc"), "{subjects:?}");
    assert!(second_events.iter().any(|r| r.subject.as_str() == "acme.anima.agent.bob"), "{second_events:#?}");

    // Each replay of the surface, which both deployments have, finds only its own message.
    for (instance, agent) in [(&first, "ada_bot"), (&second, "bob")] {
        let replayer = Replayer::new(instance.engine.log().clone(), ReplayConfig::default());
        let query = ReadQuery {
            filter: EventFilter { surface: Some(slack_dm("T1")), ..EventFilter::default() },
            ..ReadQuery::default()
        };
        let events: Vec<_> = replayer.read(query).await.expect("read").try_collect().await.expect("events");
        assert_eq!(events.len(), 1, "{agent}: {events:#?}");
        let records: Vec<StoredRecord> = events.into_iter().map(|e| e.record).collect();
        assert_eq!(agents_named(&records), [agent]);
    }

    // A third deployment with its own stream but the first one's prefix is refused, saying why.
    let refused = start(jetstream(&server, "OTHER", "anima.v1")).await.err().expect("overlapping subjects");
    let message = refused.to_string();
    assert!(matches!(refused, InstanceError::Log(LogError::Store(_))), "{message}");
    assert!(message.contains("overlap") && message.contains("subject prefix"), "{message}");

    first.stop().await.expect("stop");
    second.stop().await.expect("stop");
}

fn slack_dm(team: &str) -> SurfaceId {
    SurfaceId::Slack { team: team.into(), channel: "D1".into(), thread_ts: None }
}

/// A stream as builds before the encoding record created it and wrote to it: no metadata, and
/// `_` escaped as `_5F` in its subjects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_created_before_the_encoding_record_keeps_the_first_encoding() {
    let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
    let config = jetstream(&server, "ANIMA", "anima.v1");
    {
        // Created and written the old way: the configuration an older build created, minus the
        // metadata, and a registration and a DM on the subjects the first encoding gives.
        let client = async_nats::connect(server.url()).await.expect("connect");
        let context = async_nats::jetstream::new(client);
        context
            .create_stream(async_nats::jetstream::stream::Config {
                name: "ANIMA".into(),
                subjects: vec!["anima.v1.>".into()],
                storage: async_nats::jetstream::stream::StorageType::File,
                duplicate_window: Duration::from_secs(600),
                ..Default::default()
            })
            .await
            .expect("create the old stream");
        let old_events = [
            ("anima.v1.agent.ada_5Fbot", "old-registration", Payload::AgentRegistered(registration("ada_bot"))),
            ("anima.v1.surface.chat.t1.oc_5Fabc", "old-dm", Payload::ChatMessage(chat_dm("ada_bot", "m1").message)),
        ];
        for (subject, id, payload) in old_events {
            let envelope = proto::Envelope {
                event_id: id.into(),
                min_reader_version: 1,
                source: "anima-wake".into(),
                payload: Some(payload),
                ..Default::default()
            };
            context.publish(subject, envelope.encode_to_vec().into()).await.expect("publish").await.expect("stored");
        }
    }

    let (instance, _dir) = start(config.clone()).await.expect("the old stream is accepted");
    let engine = &instance.engine;
    assert_eq!(engine.subjects().encoding(), SubjectEncoding::Underscore);
    assert_eq!(engine.subjects().agent("ada_bot"), "anima.v1.agent.ada_5Fbot");
    // The old registration was folded: a DM to ada_bot is accepted and lands on the old subject.
    let ingested = engine.ingest_chat(chat_dm("ada_bot", "m2")).await.expect("ingest");
    assert_eq!(ingested.len(), 1);
    let records = everything(engine.log().as_ref()).await;
    assert_eq!(records.len(), 3, "{records:#?}");
    assert_eq!(records[2].subject.as_str(), "anima.v1.surface.chat.t1.oc_5Fabc");

    // Replay of the surface finds the message from before the upgrade and the one after it.
    let replayer = Replayer::new(engine.log().clone(), ReplayConfig::default());
    let query = ReadQuery {
        filter: EventFilter { surface: Some(chat_surface()), ..EventFilter::default() },
        ..ReadQuery::default()
    };
    let seqs: Vec<u64> =
        replayer.read(query).await.expect("read").map(|e| e.expect("event").record.seq).collect().await;
    assert_eq!(seqs, [2, 3]);
    instance.stop().await.expect("stop");

    // The stream still records nothing: it is not rewritten under another encoding.
    let client = async_nats::connect(server.url()).await.expect("connect");
    let mut stream = async_nats::jetstream::new(client).get_stream("ANIMA").await.expect("stream");
    let info = stream.info().await.expect("info");
    assert_eq!(info.config.metadata.get(SUBJECT_ENCODING_METADATA_KEY), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_stream_records_the_newest_encoding() {
    let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
    let (instance, _dir) = start(jetstream(&server, "ANIMA", "anima.v1")).await.expect("start");
    assert_eq!(instance.engine.subjects().encoding(), SubjectEncoding::NEWEST);
    instance.stop().await.expect("stop");
    let client = async_nats::connect(server.url()).await.expect("connect");
    let mut stream = async_nats::jetstream::new(client).get_stream("ANIMA").await.expect("stream");
    let info = stream.info().await.expect("info");
    assert_eq!(
        info.config.metadata.get(SUBJECT_ENCODING_METADATA_KEY).map(String::as_str),
        Some(SubjectEncoding::NEWEST.label())
    );
}
