//! Replay of a scripted incident: state at three points, why a send was held, filtered reads,
//! content-free counts, a tap that goes live, and `verify` against a real checkpoint — passing,
//! then naming the first differing key once the checkpoint is tampered with. Also: a data dir
//! held by a running instance is refused as locked, and a rebuild equals the live fold.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anima_engine::checkpoint::{EMBEDDED_CHECKPOINT_TREE, STATE_PREFIX};
use anima_engine::data_dir;
use anima_engine::instance::{Backend, Instance, InstanceConfig};
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::jetstream::JetStreamConfig;
use anima_engine::log::{AppendRecord, EventLog};
use anima_engine::replay::{
    self, DirectSource, EventFilter, LogPoint, LogRange, ReadQuery, ReplayConfig, ReplayError, Replayer,
};
use anima_engine::subject::{SubjectPrefix, Subjects};
use anima_engine::testing::NatsServer;
use anima_projections::intern::{AgentKey, SurfaceKey};
use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::redact::TimeBucket;
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::{SendVerdict, Verdict};
use anima_projections::wake::PlanEntry;
use anima_projections::{LogPosition, State};
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use prost::Message;

/// The subjects of the fresh logs these tests append to: the default prefix and the newest
/// encoding.
fn subjects() -> Subjects {
    Subjects::newest(SubjectPrefix::default())
}

const WAIT: Duration = Duration::from_secs(20);
const TEAM: &str = "T1";
const DM: &str = "D1";

fn envelope(id: &str, payload: Payload) -> Envelope {
    Envelope {
        event_id: id.to_owned(),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".into(),
        payload: Some(payload),
    }
}

fn ts(n: u64) -> String {
    format!("{}.000100", 1_700_000_000 + n)
}

fn target() -> proto::ReplyTarget {
    proto::ReplyTarget {
        target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
            team_id: TEAM.into(),
            channel_id: DM.into(),
            thread_ts: String::new(),
        })),
    }
}

fn dm_from_human(n: u64, text: &str) -> AppendRecord {
    let message = envelope(
        &format!("dm-{n}"),
        Payload::SlackMessage(proto::SlackMessageObserved {
            receiving_agent_id: "ada".into(),
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: TEAM.into(),
            channel_id: DM.into(),
            ts: ts(n),
            user_id: "U1".into(),
            text: text.into(),
            user_name: "MARKER-name".into(),
            ..Default::default()
        }),
    );
    record(subjects().slack_surface(TEAM, DM, None), &message)
}

fn send(n: u64) -> AppendRecord {
    let request = envelope(
        &format!("send-{n}"),
        Payload::Send(proto::SendRequested {
            agent_id: "ada".into(),
            target: Some(target()),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 12,
            mentioned_user_ids: Vec::new(),
        }),
    );
    record(subjects().slack_surface(TEAM, DM, None), &request)
}

fn record(subject: String, envelope: &Envelope) -> AppendRecord {
    AppendRecord { subject, msg_id: envelope.event_id.clone(), payload: Bytes::from(envelope.encode_to_vec()) }
}

fn agent_record(id: &str, payload: Payload) -> AppendRecord {
    record(subjects().agent("ada"), &envelope(id, payload))
}

/// The incident: ada is woken by a DM, starts, another DM arrives, her send is held, the resend
/// is allowed, she posts and finishes.
///
/// | seq | event |
/// |---|---|
/// | 1 | ada registered |
/// | 2 | DM #1 from U1 (wake dm) |
/// | 3 | claim |
/// | 4 | start: cursor 1 |
/// | 5 | DM #2 from U1 (queued) |
/// | 6 | send: held over #2 |
/// | 7 | send: allowed |
/// | 8 | ada's post confirmed (#3) |
/// | 9 | finish completed |
async fn incident(log: &dyn EventLog) {
    let registration = Payload::AgentRegistered(proto::AgentRegistered {
        agent_id: "ada".into(),
        slack_bot_user_id: "U0ADA".into(),
        slack_bot_id: "B0ADA".into(),
        display_name: "MARKER-display".into(),
        ..Default::default()
    });
    let claim = Payload::WakeClaim(proto::WakeClaimRequested {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        ..Default::default()
    });
    let first = [agent_record("agent", registration), dm_from_human(1, "MARKER-hello"), agent_record("claim", claim)];
    let mut state = State::new();
    for record in first {
        let seq = log.append(record.clone()).await.unwrap().seq();
        state.apply_bytes(LogPosition { seq, at_ns: seq as i64 }, &record.payload);
    }
    // The runtime hands back the plan its claim returned.
    let active = state.queue("ada").and_then(|q| q.active.clone()).expect("the claim took the wake");
    let plan = active.plan.iter().map(PlanEntry::to_plan_surface).collect();
    let start = Payload::WakeStart(proto::WakeStartRequested {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        item_id: active.item.id.clone(),
        plan,
    });
    let confirmed = envelope(
        "confirmed",
        Payload::SendConfirmed(proto::SendConfirmed {
            agent_id: "ada".into(),
            target: Some(target()),
            kind: proto::SendKind::Message as i32,
            ts: ts(3),
            text: "MARKER-reply".into(),
            ..Default::default()
        }),
    );
    let finish = Payload::WakeFinish(proto::WakeFinishRequested {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        item_id: active.item.id.clone(),
        outcome: proto::WakeOutcome::Completed as i32,
        reason: "MARKER-reason".into(),
        ..Default::default()
    });
    let rest = [
        agent_record("start", start),
        dm_from_human(2, "MARKER-are you there?"),
        send(6),
        send(7),
        record(subjects().slack_surface(TEAM, DM, None), &confirmed),
        agent_record("finish", finish),
    ];
    for record in rest {
        log.append(record).await.unwrap();
    }
    assert_eq!(log.last_seq().await.unwrap(), 9);
}

async fn incident_log() -> Arc<dyn EventLog> {
    let db = sled::Config::new().temporary(true).open().unwrap();
    let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).unwrap());
    incident(log.as_ref()).await;
    log
}

fn dm() -> SurfaceId {
    SurfaceId::Slack { team: TEAM.into(), channel: DM.into(), thread_ts: None }
}

#[tokio::test]
async fn state_at_three_points_gives_the_cursors_and_the_queue() {
    let log = incident_log().await;
    let replayer = Replayer::new(log.clone(), ReplayConfig::default());

    let woken = replayer.rebuild(Some(LogPoint::Seq(2))).await.unwrap();
    assert_eq!(woken.seq, 2);
    assert_eq!(woken.state.cursor("ada", &dm()), None);
    let queue = woken.state.queue("ada").unwrap();
    assert_eq!(queue.queued().map(|i| i.reason.as_str()).collect::<Vec<_>>(), ["dm"]);
    assert!(queue.active.is_none());

    let started = replayer.rebuild(Some(LogPoint::Seq(4))).await.unwrap();
    assert_eq!(started.state.cursor("ada", &dm()), Some(1));
    let active = started.state.queue("ada").unwrap().active.clone().unwrap();
    assert_eq!(active.started_seq, Some(4));

    let finished = replayer.rebuild(Some(LogPoint::Seq(9))).await.unwrap();
    assert_eq!(finished.state.cursor("ada", &dm()), Some(2), "the hold moved the cursor to the tail");
    assert_eq!(finished.state.journal(&dm()).unwrap().tail, 3);
    let queue = finished.state.queue("ada").unwrap();
    assert!(queue.active.is_none());
    assert_eq!(queue.queued_len(), 1, "the second DM waits (its row is covered: the next claim settles it)");

    // A log time means the newest event at or before it.
    let time_of_4 = log.get(4).await.unwrap().unwrap().timestamp_ns;
    let by_time = replayer.rebuild(Some(LogPoint::TimeNs(time_of_4))).await.unwrap();
    assert_eq!(by_time.seq, 4);
    assert_eq!(by_time.state_sha256(), started.state_sha256());
    // Rebuilt from the start or from a snapshot, the state is the same.
    let fresh = Replayer::new(log.clone(), ReplayConfig::default()).rebuild(Some(LogPoint::Seq(9))).await.unwrap();
    assert_eq!(fresh.state.canonical_bytes(), finished.state.canonical_bytes());

    let beyond = replayer.rebuild(Some(LogPoint::Seq(10))).await.unwrap_err();
    assert!(matches!(beyond, ReplayError::InvalidArgument { field: "at.seq", .. }), "{beyond}");
}

/// Asked at later and later points (the log's head as it grows), the replayer takes its newest
/// snapshot over instead of copying it; whatever the order of the calls, every answer equals a
/// rebuild from the start, earlier points included.
#[tokio::test]
async fn states_asked_in_any_order_equal_rebuilds_from_the_start() {
    let log = incident_log().await;
    let replayer = Replayer::new(log.clone(), ReplayConfig::default());
    for seq in [2, 3, 5, 9, 4, 6, 1, 9, 7] {
        let answer = replayer.rebuild(Some(LogPoint::Seq(seq))).await.unwrap().state.canonical_bytes();
        let fresh =
            Replayer::new(log.clone(), ReplayConfig::default()).rebuild(Some(LogPoint::Seq(seq))).await.unwrap();
        assert!(answer == fresh.state.canonical_bytes(), "the state at seq {seq} differs from a rebuild");
    }
    // A caller still holding the newest snapshot (a new replayer's only one) keeps it as it
    // was, and it stays kept for the next call at its point.
    let replayer = Replayer::new(log.clone(), ReplayConfig::default());
    let held = replayer.rebuild(Some(LogPoint::Seq(4))).await.unwrap();
    let before = held.state.canonical_bytes();
    let later = replayer.rebuild(Some(LogPoint::Seq(8))).await.unwrap();
    assert_eq!((held.seq, later.seq), (4, 8));
    assert!(held.state.canonical_bytes() == before, "a state handed out changed under its holder");
    let again = replayer.rebuild(Some(LogPoint::Seq(4))).await.unwrap();
    assert!(Arc::ptr_eq(&held, &again), "the held snapshot is still the one kept for seq 4");
}

#[tokio::test]
async fn explain_names_the_foreign_rows_of_a_held_send() {
    let log = incident_log().await;
    let replayer = Replayer::new(log, ReplayConfig::default());

    let held = replayer.explain(6).await.unwrap();
    assert_eq!(held.event_type, "send");
    assert!(matches!(held.verdict, Some(Verdict::Send(SendVerdict::Held(_)))), "{:?}", held.verdict);
    let cursor = held.cursor.clone().unwrap();
    assert_eq!((cursor.cursor, cursor.tail, cursor.foreign_rows_after_cursor), (Some(1), 2, 1));
    let rows: Vec<(u64, u64, &str)> =
        cursor.rows_after_cursor.iter().map(|r| (r.ordinal, r.seq, r.user_id.as_str())).collect();
    assert_eq!(rows, [(2, 5, "U1")]);
    let facts = held.facts.join("\n");
    assert!(facts.contains("#2 (seq 5, user U1)") && facts.contains("held"), "{facts}");

    let allowed = replayer.explain(7).await.unwrap();
    assert!(matches!(allowed.verdict, Some(Verdict::Send(SendVerdict::Allowed { .. }))));
    let cursor = allowed.cursor.unwrap();
    assert_eq!((cursor.cursor, cursor.tail, cursor.rows_after_cursor.len()), (Some(2), 2, 0));
    assert!(allowed.facts.join("\n").contains("no row is after the cursor"), "{:?}", allowed.facts);

    let start = replayer.explain(4).await.unwrap();
    assert!(start.facts.iter().any(|f| f.contains("still was")), "{:?}", start.facts);

    assert!(matches!(replayer.explain(99).await, Err(ReplayError::NotFound(_))));
    assert!(matches!(replayer.explain(0).await, Err(ReplayError::InvalidArgument { .. })));
}

async fn read_seqs(replayer: &Replayer, query: ReadQuery) -> Vec<u64> {
    let events: Vec<_> = replayer.read(query).await.unwrap().try_collect().await.unwrap();
    events.iter().map(|e| e.record.seq).collect()
}

#[tokio::test]
async fn read_filters_by_surface_agent_type_range_and_limit() {
    let log = incident_log().await;
    let replayer = Replayer::new(log.clone(), ReplayConfig::default());
    let all = ReadQuery::default();
    assert_eq!(read_seqs(&replayer, all.clone()).await, (1..=9).collect::<Vec<_>>());

    let surface = EventFilter { surface: Some(dm()), ..EventFilter::default() };
    assert_eq!(read_seqs(&replayer, ReadQuery { filter: surface, ..all.clone() }).await, [2, 5, 6, 7, 8]);

    let bob = EventFilter { agent: Some("bob".into()), ..EventFilter::default() };
    assert!(read_seqs(&replayer, ReadQuery { filter: bob, ..all.clone() }).await.is_empty());
    let ada = EventFilter { agent: Some("ada".into()), ..EventFilter::default() };
    assert_eq!(read_seqs(&replayer, ReadQuery { filter: ada, ..all.clone() }).await.len(), 9);

    let sends = EventFilter { event_types: BTreeSet::from(["send".to_owned()]), ..EventFilter::default() };
    let query = ReadQuery { filter: sends, with_verdicts: true, ..all.clone() };
    let events: Vec<_> = replayer.read(query).await.unwrap().try_collect().await.unwrap();
    let verdicts: Vec<&str> = events
        .iter()
        .map(|e| match &e.verdict {
            Some(Verdict::Send(SendVerdict::Held(_))) => "held",
            Some(Verdict::Send(SendVerdict::Allowed { .. })) => "allowed",
            _ => "other",
        })
        .collect();
    assert_eq!(verdicts, ["held", "allowed"]);

    let time = |seq| {
        let log = log.clone();
        async move { log.get(seq).await.unwrap().unwrap().timestamp_ns }
    };
    let range = LogRange { from: Some(LogPoint::TimeNs(time(4).await)), to: Some(LogPoint::TimeNs(time(6).await)) };
    assert_eq!(read_seqs(&replayer, ReadQuery { range, ..all.clone() }).await, [4, 5, 6]);
    let range = LogRange { from: Some(LogPoint::TimeNs(time(4).await - 1)), to: Some(LogPoint::TimeNs(0)) };
    assert!(read_seqs(&replayer, ReadQuery { range, ..all.clone() }).await.is_empty());
    let range = LogRange { from: Some(LogPoint::Seq(3)), to: None };
    assert_eq!(read_seqs(&replayer, ReadQuery { range, limit: Some(2), ..all }).await, [3, 4]);
}

#[tokio::test]
async fn counts_give_the_hold_rate_wakes_and_placements_without_content() {
    let log = incident_log().await;
    let replayer = Replayer::new(log, ReplayConfig::default());
    let (from, to, counts) = replayer.counts(LogRange::default(), TimeBucket::Day).await.unwrap();
    assert_eq!((from, to), (1, 9));
    let total = &counts.total;
    assert_eq!((total.events, total.sends_allowed, total.sends_held), (9, 1, 1));
    assert_eq!(total.send_hold_rate(), 0.5);
    assert_eq!(total.wakes_by_reason.get("dm"), Some(&2));
    assert_eq!((total.claims, total.starts), (1, 1));
    assert_eq!(total.finishes_by_outcome.get("completed"), Some(&1));
    assert_eq!((total.dm_replies_top_level, total.dm_replies_threaded), (1, 0));
    let types: u64 = counts.buckets.values().flat_map(|b| b.types.values()).map(|t| t.events).sum();
    assert_eq!(types, 9);
    assert!(!format!("{counts:?}").contains("MARKER"));

    // Counting only a part still judges it with the state before it.
    let (_, _, sends) = replayer
        .counts(LogRange { from: Some(LogPoint::Seq(6)), to: Some(LogPoint::Seq(6)) }, TimeBucket::Minute)
        .await
        .unwrap();
    assert_eq!((sends.total.events, sends.total.sends_held), (1, 1));
}

/// `Analytics.Counts` of a live instance answers from its maintained counters exactly what a
/// refold of the log answers, also after a restart restored the counters from the checkpoint;
/// a part of the log the counters cannot cut exactly is refolded.
#[tokio::test]
async fn maintained_counts_equal_a_refold_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let instance = start_instance(dir.path()).await;
    incident(instance.engine.log().as_ref()).await;
    // "Up to now" is what the fold has counted; once it has applied the whole incident, that is
    // the whole log.
    instance.engine.projection().wait_applied(9, WAIT).await.unwrap();
    let replayer = Replayer::new(instance.engine.log().clone(), ReplayConfig::default());
    let everything = LogRange::default();
    let refolded = replayer.counts(everything, TimeBucket::Day).await.unwrap();
    let projection = Some(instance.engine.projection().as_ref());
    let maintained = anima_engine::analytics::answer_counts(&replayer, projection, everything, TimeBucket::Day).await;
    assert_eq!(maintained.unwrap(), refolded);
    assert!(instance.engine.projection().analytics().buckets_len() > 0, "the runner counted");
    let part = LogRange { from: Some(LogPoint::Seq(6)), to: Some(LogPoint::Seq(6)) };
    let (_, _, sends) =
        anima_engine::analytics::answer_counts(&replayer, projection, part, TimeBucket::Minute).await.unwrap();
    assert_eq!((sends.total.events, sends.total.sends_held), (1, 1));
    drop(replayer);
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();

    let instance = start_instance(dir.path()).await;
    let replayer = Replayer::new(instance.engine.log().clone(), ReplayConfig::default());
    let restored = instance.engine.projection().analytics().counts(1, 9, TimeBucket::Day, 9);
    assert_eq!(restored, Some(refolded.2), "the counters came back from the checkpoint");
    drop(replayer);
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
}

async fn start_instance(dir: &std::path::Path) -> Instance {
    Instance::start(InstanceConfig::new(dir, Backend::Embedded(EmbeddedConfig::default()))).await.unwrap()
}

/// An instance on `dir` that has folded the incident, and its state's canonical bytes.
async fn instance_after_incident(dir: &std::path::Path) -> (Instance, Vec<u8>) {
    let instance = start_instance(dir).await;
    incident(instance.engine.log().as_ref()).await;
    instance.engine.projection().wait_applied(9, WAIT).await.unwrap();
    let live = instance.engine.projection().state().canonical_bytes();
    (instance, live)
}

/// A data dir an earlier version wrote keeps its checkpoints in the sled database of the log.
/// The first start drops them and serves the state a fold of the log gives; nothing of them is
/// left in sled.
#[tokio::test]
async fn checkpoints_an_earlier_version_kept_in_sled_are_dropped_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let (instance, live) = instance_after_incident(dir.path()).await;
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
    // A data dir of the earlier version: its checkpoint was a sled tree beside the log, and it
    // has no checkpoint store of its own yet.
    std::fs::remove_dir_all(dir.path().join(anima_engine::checkpoint::CHECKPOINT_DIR)).unwrap();
    {
        let db = data_dir::open(dir.path(), 16 * 1024 * 1024, false).unwrap();
        let old = db.open_tree(EMBEDDED_CHECKPOINT_TREE).unwrap();
        old.insert([STATE_PREFIX, 0], &[0xff; 16][..]).unwrap();
        old.insert(b"m:fold_version", &[0, 0, 0, 1][..]).unwrap();
        drop(old);
        data_dir::close(db, dir.path(), data_dir::RELEASE_WAIT_DEFAULT).unwrap();
    }
    // The start does not read the old tree: the state is folded from the log again, whole.
    let instance = start_instance(dir.path()).await;
    instance.engine.projection().wait_applied(9, WAIT).await.unwrap();
    assert_eq!(instance.engine.projection().state().canonical_bytes(), live);
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
    let db = data_dir::open(dir.path(), 16 * 1024 * 1024, false).unwrap();
    let names: Vec<_> = db.tree_names().iter().map(|name| String::from_utf8_lossy(name).into_owned()).collect();
    assert!(!names.iter().any(|name| name.starts_with("checkpoint")), "{names:?}");
    data_dir::close(db, dir.path(), data_dir::RELEASE_WAIT_DEFAULT).unwrap();
}

/// A second instance started on a data dir another one holds is refused with the data dir's own
/// error, although its checkpoint store opens beside sled and the log: the running instance keeps
/// serving and checkpointing, and what it folded comes back at the next start.
#[tokio::test]
async fn a_second_instance_on_a_data_dir_in_use_is_refused_and_the_first_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (instance, _) = instance_after_incident(dir.path()).await;
    let refused = Instance::start(InstanceConfig::new(dir.path(), Backend::Embedded(EmbeddedConfig::default())))
        .await
        .err()
        .expect("a second instance on the same data dir");
    let message = refused.to_string();
    assert!(message.contains("is in use"), "{message}");
    instance.engine.log().append(send(10)).await.unwrap();
    instance.engine.projection().wait_applied(10, WAIT).await.unwrap();
    let live = instance.engine.projection().state().canonical_bytes();
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
    let instance = start_instance(dir.path()).await;
    assert_eq!(instance.engine.projection().applied_seq(), 10);
    assert_eq!(instance.engine.projection().state().canonical_bytes(), live);
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
}

#[tokio::test]
async fn verify_passes_on_a_checkpoint_and_names_the_first_tampered_key() {
    let dir = tempfile::tempdir().unwrap();
    let (instance, live) = instance_after_incident(dir.path()).await;

    // While the instance runs, the data dir is locked.
    let locked = DirectSource::open_data_dir(dir.path()).unwrap_err();
    assert!(matches!(locked, ReplayError::Locked { .. }), "{locked}");

    // A tap sends redacted events with the live outcomes, then goes live.
    let mut tap =
        replay::tap(instance.engine.log().clone(), Some(instance.engine.projection().clone()), 6, BTreeSet::new())
            .await
            .unwrap();
    let first = tokio::time::timeout(WAIT, tap.next()).await.unwrap().unwrap().unwrap();
    assert_eq!((first.seq, first.outcome.map(|o| o.kind)), (6, Some("send_held".to_owned())));
    for _ in 7..=9 {
        tokio::time::timeout(WAIT, tap.next()).await.unwrap().unwrap().unwrap();
    }
    instance.engine.log().append(send(10)).await.unwrap();
    let live_event = tokio::time::timeout(WAIT, tap.next()).await.unwrap().unwrap().unwrap();
    assert_eq!((live_event.seq, live_event.event_type.as_str()), (10, "send"));
    assert!(!format!("{live_event:?}").contains("MARKER"));
    drop(tap);
    instance.engine.projection().wait_applied(10, WAIT).await.unwrap();
    let live_after = instance.engine.projection().state().canonical_bytes();
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();

    let source = DirectSource::open_data_dir(dir.path()).unwrap();
    let replayer = Replayer::new(source.log.clone(), ReplayConfig::default());
    let nine = replayer.rebuild(Some(LogPoint::Seq(9))).await.unwrap();
    assert_eq!(nine.state.canonical_bytes(), live, "a rebuild equals the live fold");
    let ten = replayer.rebuild(None).await.unwrap();
    assert_eq!(ten.state.canonical_bytes(), live_after);
    let report = source.verify(ReplayConfig::default()).await.unwrap();
    assert!(report.passed(), "{report:?}");
    assert_eq!((report.applied_seq, report.checkpoint_sha256 == report.rebuilt_sha256), (10, true));
    drop((source, replayer));
    released(dir.path()).await;

    // Tamper with ada's cursor on the DM in the checkpoint ((surface, agent) → cursor).
    {
        let db = anima_engine::checkpoint::CheckpointDb::open(dir.path(), 16 * 1024 * 1024).unwrap();
        let tree = db.existing(EMBEDDED_CHECKPOINT_TREE).unwrap().expect("the checkpoint");
        let cursors_tag = 43u8;
        let cursors: Vec<_> =
            tree.prefix([STATE_PREFIX, cursors_tag]).map(|entry| entry.into_inner().unwrap()).collect();
        assert_eq!(cursors.len(), 1, "ada's cursor on the DM is the only one: {cursors:?}");
        let (key, cursor) = &cursors[0];
        let (_, _): (SurfaceKey, AgentKey) = postcard::from_bytes(&key[2..]).unwrap();
        let cursor: u64 = postcard::from_bytes(cursor).unwrap();
        tree.insert(key.clone(), postcard::to_stdvec(&(cursor + 1)).unwrap()).unwrap();
        db.persist().unwrap();
        drop((tree, db));
        data_dir::wait_until_released(dir.path(), data_dir::RELEASE_WAIT_DEFAULT).unwrap();
    }
    let source = DirectSource::open_data_dir(dir.path()).unwrap();
    let report = source.verify(ReplayConfig::default()).await.unwrap();
    assert!(!report.passed());
    let difference = report.first_difference.unwrap();
    assert_eq!((difference.table.as_str(), difference.note.as_str()), ("cursors", "values differ"));
    assert!(difference.key.contains(&dm().to_string()), "the key is named by its surface: {}", difference.key);
}

/// A JetStream stream is read directly: a missing stream is refused (not created), an
/// existing one replays like the embedded log, and its checkpoint in a data dir verifies.
#[tokio::test]
async fn a_jetstream_stream_is_read_directly_and_never_created() {
    let server = tokio::task::spawn_blocking(NatsServer::start).await.unwrap();
    let config = JetStreamConfig { url: server.url(), stream: "REPLAYTEST".into(), ..JetStreamConfig::default() };
    let missing = DirectSource::open_jetstream(config.clone(), None).await.unwrap_err();
    assert!(matches!(missing, ReplayError::Source(_)), "{missing}");

    let dir = tempfile::tempdir().unwrap();
    let instance = Instance::start(InstanceConfig::new(dir.path(), Backend::JetStream(config.clone()))).await.unwrap();
    incident(instance.engine.log().as_ref()).await;
    instance.engine.projection().wait_applied(9, WAIT).await.unwrap();
    let live = instance.engine.projection().state().canonical_bytes();
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();

    let source = DirectSource::open_jetstream(config.clone(), Some(dir.path())).await.unwrap();
    let replayer = Replayer::new(source.log.clone(), ReplayConfig::default());
    assert_eq!(replayer.rebuild(None).await.unwrap().state.canonical_bytes(), live);
    let held = replayer.explain(6).await.unwrap();
    assert!(matches!(held.verdict, Some(Verdict::Send(SendVerdict::Held(_)))));
    let report = source.verify(ReplayConfig::default()).await.unwrap();
    assert!(report.passed(), "{report:?}");
}

#[tokio::test]
async fn a_directory_without_data_is_refused_not_created() {
    let dir = tempfile::tempdir().unwrap();
    let missing = DirectSource::open_data_dir(dir.path().join("nothing")).unwrap_err();
    assert!(matches!(missing, ReplayError::Source(_)), "{missing}");
    assert!(!dir.path().join("nothing").exists());
}

/// A rebuild through the replayer equals a direct fold of the raw log, byte for byte; it also
/// prints the rebuild speed next to a raw read of the same log (for figures run it with
/// `REPLAY_EVENTS=200000 cargo test --release -p anima-engine --test it
/// replay::rebuild_equals_a_direct_fold -- --nocapture`; CI runs a small log). The mix: 70%
/// replies in threads nobody follows (journaled, routed, no wake), 20% send requests, 10% DMs
/// (wakes), over 50 channels.
#[tokio::test]
async fn rebuild_equals_a_direct_fold() {
    let events: u64 = std::env::var("REPLAY_EVENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000);
    let db = sled::Config::new().temporary(true).open().unwrap();
    let log: Arc<dyn EventLog> = Arc::new(EmbeddedLog::open(db, EmbeddedConfig::default()).unwrap());
    incident(log.as_ref()).await;
    let mut batch = Vec::new();
    for n in 0..events {
        let channel = format!("C{}", n % 50);
        batch.push(match n % 10 {
            0 => dm_from_human(1_000 + n, "a direct message of some length"),
            1 | 2 => send(1_000 + n),
            _ => {
                let message = envelope(
                    &format!("reply-{n}"),
                    Payload::SlackMessage(proto::SlackMessageObserved {
                        receiving_agent_id: "ada".into(),
                        kind: proto::SlackDeliveryKind::Message as i32,
                        team_id: TEAM.into(),
                        channel_id: channel.clone(),
                        ts: ts(1_000 + n),
                        thread_ts: ts(n % 500),
                        user_id: format!("U{}", n % 97),
                        text: "a reply in a thread nobody follows".into(),
                        ..Default::default()
                    }),
                );
                record(subjects().slack_surface(TEAM, &channel, Some(&ts(n % 500))), &message)
            }
        });
        if batch.len() == 4_096 {
            log.append_batch(std::mem::take(&mut batch)).await.unwrap();
        }
    }
    log.append_batch(batch).await.unwrap();
    let last = log.last_seq().await.unwrap();

    let started = Instant::now();
    let records: Vec<_> = log.read(1, last, None).await.unwrap().try_collect().await.unwrap();
    let raw = started.elapsed();
    let started = Instant::now();
    let mut state = State::new();
    for record in &records {
        state.apply_bytes(LogPosition { seq: record.seq, at_ns: record.timestamp_ns }, &record.payload);
    }
    let fold_only = started.elapsed();
    let started = Instant::now();
    let rebuilt = Replayer::new(log.clone(), ReplayConfig::default()).rebuild(None).await.unwrap();
    let rebuild = started.elapsed();
    assert_eq!((records.len() as u64, rebuilt.seq), (last, last));
    assert_eq!(rebuilt.state.canonical_bytes(), state.canonical_bytes());
    let rate = |d: Duration| last as f64 / d.as_secs_f64();
    println!(
        "{last} events: raw read {:.0}/s ({raw:?}); fold alone {:.0}/s ({fold_only:?}); rebuild (read + fold) \
         {:.0}/s ({rebuild:?}); rebuild / raw read = {:.2}",
        rate(raw),
        rate(fold_only),
        rate(rebuild),
        rate(rebuild) / rate(raw)
    );
}

/// Waits until nothing holds sled's lock on `dir` any more (the direct source just dropped).
async fn released(dir: &std::path::Path) {
    let dir = dir.to_path_buf();
    tokio::task::spawn_blocking(move || data_dir::wait_until_released(&dir, data_dir::RELEASE_WAIT_DEFAULT))
        .await
        .unwrap()
        .unwrap();
}

/// The log of an instance, noting where each `read` starts.
struct ReadsNoted {
    inner: Arc<dyn EventLog>,
    starts: std::sync::Mutex<Vec<u64>>,
}

#[async_trait::async_trait]
impl EventLog for ReadsNoted {
    fn identity(&self) -> String {
        self.inner.identity()
    }
    fn subjects(&self) -> &Subjects {
        self.inner.subjects()
    }
    async fn append(&self, record: AppendRecord) -> anima_engine::log::LogResult<anima_engine::log::AppendOutcome> {
        self.inner.append(record).await
    }
    async fn append_batch(
        &self,
        records: Vec<AppendRecord>,
    ) -> anima_engine::log::LogResult<Vec<anima_engine::log::AppendOutcome>> {
        self.inner.append_batch(records).await
    }
    async fn read(
        &self,
        from_seq: u64,
        to_seq: u64,
        filter: Option<anima_engine::log::SubjectFilter>,
    ) -> anima_engine::log::LogResult<
        futures::stream::BoxStream<'static, anima_engine::log::LogResult<anima_engine::log::StoredRecord>>,
    > {
        self.starts.lock().unwrap().push(from_seq);
        self.inner.read(from_seq, to_seq, filter).await
    }
    async fn follow(
        &self,
        from_seq: u64,
        filter: Option<anima_engine::log::SubjectFilter>,
    ) -> anima_engine::log::LogResult<
        futures::stream::BoxStream<'static, anima_engine::log::LogResult<anima_engine::log::StoredRecord>>,
    > {
        self.inner.follow(from_seq, filter).await
    }
    async fn get(&self, seq: u64) -> anima_engine::log::LogResult<Option<anima_engine::log::StoredRecord>> {
        self.inner.get(seq).await
    }
    async fn last_seq(&self) -> anima_engine::log::LogResult<u64> {
        self.inner.last_seq().await
    }
}

/// A server's replayer starts a rebuild that has no snapshot before its point from the runner's
/// checkpoint, when the checkpoint is at or before the point: it reads no event up to the
/// checkpoint, and the state and an explanation equal those of a fold from the log's start. A
/// point before the checkpoint is still folded from the start.
#[tokio::test]
async fn a_rebuild_past_the_checkpoint_starts_from_it_and_equals_a_fold_from_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (instance, _) = instance_after_incident(dir.path()).await;
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();
    let instance = start_instance(dir.path()).await;
    let checkpointed = instance.checkpoints.checkpointed_seq().unwrap();
    assert_eq!(checkpointed, 9, "the instance closed with a checkpoint of the incident");
    let identity = instance.engine.log().identity();
    assert_eq!(instance.checkpoints.usable_seq(&identity).unwrap(), Some(9), "usable on its own stream");
    assert_eq!(instance.checkpoints.usable_seq("another stream").unwrap(), None, "not on another stream");
    instance.engine.log().append(send(10)).await.unwrap();
    instance.engine.projection().wait_applied(10, WAIT).await.unwrap();
    let live = instance.engine.projection().state().canonical_bytes();

    let noted = Arc::new(ReadsNoted { inner: instance.engine.log().clone(), starts: Default::default() });
    let from_checkpoint =
        Replayer::new(noted.clone(), ReplayConfig::default()).with_checkpoint(instance.checkpoints.clone());
    let from_start = Replayer::new(instance.engine.log().clone(), ReplayConfig::default());
    let ten = from_checkpoint.rebuild(Some(LogPoint::Seq(10))).await.unwrap();
    assert_eq!(ten.state.canonical_bytes(), live, "the rebuild equals the live fold");
    let starts = noted.starts.lock().unwrap().clone();
    assert!(starts.iter().all(|&from| from > checkpointed), "no event up to the checkpoint was read: {starts:?}");
    assert_eq!(ten.state_sha256(), from_start.rebuild(Some(LogPoint::Seq(10))).await.unwrap().state_sha256());
    assert_eq!(ten.seq, 10);
    assert_eq!(ten.log_time_ns, instance.engine.log().get(10).await.unwrap().unwrap().timestamp_ns);
    let explained = Replayer::new(noted.clone(), ReplayConfig::default())
        .with_checkpoint(instance.checkpoints.clone())
        .explain(10)
        .await
        .unwrap();
    assert_eq!(format!("{explained:?}"), format!("{:?}", from_start.explain(10).await.unwrap()));

    // A kept snapshot before the point is folded on from while it is close enough; once it is
    // further behind than the configured distance, the checkpoint between them is the start.
    for (distance, starts_at_checkpoint) in
        [(ReplayConfig::default().checkpoint_over_snapshot_events_min, false), (5, true)]
    {
        let config = ReplayConfig { checkpoint_over_snapshot_events_min: distance, ..ReplayConfig::default() };
        let replayer = Replayer::new(noted.clone(), config).with_checkpoint(instance.checkpoints.clone());
        replayer.rebuild(Some(LogPoint::Seq(2))).await.unwrap();
        noted.starts.lock().unwrap().clear();
        let ten = replayer.rebuild(Some(LogPoint::Seq(10))).await.unwrap();
        assert_eq!(ten.state.canonical_bytes(), live, "distance {distance}");
        let starts = noted.starts.lock().unwrap().clone();
        if starts_at_checkpoint {
            assert!(starts.iter().all(|&from| from > checkpointed), "distance {distance}: {starts:?}");
        } else {
            assert_eq!(starts, vec![3], "distance {distance}: folded on from the snapshot at 2");
        }
    }

    noted.starts.lock().unwrap().clear();
    let before = Replayer::new(noted.clone(), ReplayConfig::default()).with_checkpoint(instance.checkpoints.clone());
    let five = before.rebuild(Some(LogPoint::Seq(5))).await.unwrap();
    assert_eq!(
        five.state.canonical_bytes(),
        from_start.rebuild(Some(LogPoint::Seq(5))).await.unwrap().state.canonical_bytes()
    );
    assert_eq!(noted.starts.lock().unwrap().first(), Some(&1), "a point before the checkpoint folds from the start");
    drop((from_checkpoint, from_start, before, noted));
    instance.close(data_dir::RELEASE_WAIT_DEFAULT).await.unwrap();

    // The replay tool's direct source starts from the data dir's checkpoint the same way.
    let source = DirectSource::open_data_dir(dir.path()).unwrap();
    let checkpoint = source.checkpoint_store().expect("the data dir's checkpoint");
    let noted = Arc::new(ReadsNoted { inner: source.log.clone(), starts: Default::default() });
    let head =
        Replayer::new(noted.clone(), ReplayConfig::default()).with_checkpoint(checkpoint).rebuild(None).await.unwrap();
    assert_eq!(head.state.canonical_bytes(), live);
    assert!(noted.starts.lock().unwrap().iter().all(|&from| from > checkpointed));
}
