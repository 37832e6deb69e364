//! One conformance suite for both event-log backends: every check is written once
//! against `&dyn EventLog` and instantiated for the embedded log (sled in a temporary directory)
//! and for JetStream (a real `nats-server` from `anima_engine::testing`).
//!
//! Each test gets a fresh log, so seqs start at 1. Every read is bounded by a timeout: a read that
//! does not terminate fails the test instead of hanging it.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anima_engine::data_dir;
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{AppendOutcome, AppendRecord, EventLog, LogError, StoredRecord, SubjectFilter};
use anima_engine::subject::{SubjectEncoding, SubjectPrefix, Subjects};
use anima_engine::testing::NatsServer;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;

/// The subjects of the fresh logs these tests append to: the default prefix and the newest
/// encoding.
fn subjects() -> Subjects {
    Subjects::newest(SubjectPrefix::default())
}

/// Bound on any single read or follow step in these tests.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// A log under test plus what it takes to reopen it.
struct Fixture {
    log: Option<Arc<dyn EventLog>>,
    backend: Backend,
}

enum Backend {
    Embedded { dir: tempfile::TempDir, config: EmbeddedConfig },
    JetStream { server: NatsServer, config: JetStreamConfig },
}

impl Fixture {
    fn embedded() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        // A small group bound so batches here span several group commits.
        let config = EmbeddedConfig { group_commit_records_max: 100, ..EmbeddedConfig::default() };
        let mut fixture = Fixture { log: None, backend: Backend::Embedded { dir, config } };
        fixture.log = Some(fixture.open_embedded());
        assert_eq!(fixture.log().subjects(), &subjects(), "a new log: the default prefix, the newest encoding");
        fixture
    }

    async fn jetstream() -> Fixture {
        let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
        // A small ack window so batches here exercise the window.
        let config = JetStreamConfig {
            url: server.url(),
            ack_window: 64,
            request_timeout: Duration::from_secs(5),
            ..JetStreamConfig::default()
        };
        let log = JetStreamLog::connect(config.clone()).await.expect("connect to JetStream");
        assert_eq!(log.subjects(), &subjects(), "a new log: the default prefix, the newest encoding");
        Fixture { log: Some(Arc::new(log)), backend: Backend::JetStream { server, config } }
    }

    fn open_embedded(&self) -> Arc<dyn EventLog> {
        let Backend::Embedded { dir, config } = &self.backend else {
            unreachable!("embedded fixture");
        };
        let db = data_dir::open(dir.path(), 16 * 1024 * 1024, true).expect("open sled");
        Arc::new(EmbeddedLog::open(db, config.clone()).expect("open embedded log"))
    }

    fn log(&self) -> &dyn EventLog {
        self.log.as_deref().expect("log is open")
    }

    fn shared_log(&self) -> Arc<dyn EventLog> {
        self.log.clone().expect("log is open")
    }

    /// Closes the log and opens it again: the embedded log drops and reopens its `Db`; JetStream
    /// kills and restarts the server on the same store, then reconnects.
    async fn reopen(&mut self) {
        let log = self.log.take().expect("log is open");
        assert_eq!(Arc::strong_count(&log), 1, "the test still holds the log somewhere");
        drop(log);
        match &mut self.backend {
            Backend::Embedded { dir, .. } => {
                // Closed means closed: wait until sled has let go of the directory, which its
                // background threads do a moment after the last handle drops.
                let path = dir.path().to_path_buf();
                tokio::task::spawn_blocking(move || {
                    data_dir::wait_until_released(&path, data_dir::RELEASE_WAIT_DEFAULT)
                })
                .await
                .expect("release task")
                .expect("the embedded log let go of its data dir");
                self.log = Some(self.open_embedded());
            }
            Backend::JetStream { server, config } => {
                tokio::task::block_in_place(|| server.restart());
                let log = JetStreamLog::connect(config.clone()).await.expect("reconnect to JetStream");
                self.log = Some(Arc::new(log));
            }
        }
    }
}

fn record(subject: &str, msg_id: &str, payload: &str) -> AppendRecord {
    AppendRecord {
        subject: subject.to_owned(),
        msg_id: msg_id.to_owned(),
        payload: Bytes::copy_from_slice(payload.as_bytes()),
    }
}

fn filter(pattern: &str) -> Option<SubjectFilter> {
    Some(SubjectFilter(pattern.to_owned()))
}

fn now_ns() -> i64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_nanos();
    i64::try_from(nanos).expect("clock before 2262")
}

/// Reads `from..=to` to the end, failing if the stream does not terminate.
async fn read_all(log: &dyn EventLog, from_seq: u64, to_seq: u64, filter: Option<SubjectFilter>) -> Vec<StoredRecord> {
    let stream = log.read(from_seq, to_seq, filter).await.expect("read");
    tokio::time::timeout(STEP_TIMEOUT, stream.map(|r| r.expect("read item")).collect())
        .await
        .unwrap_or_else(|_| panic!("read({from_seq}, {to_seq}) did not terminate"))
}

async fn read_seqs(log: &dyn EventLog, from_seq: u64, to_seq: u64, filter: Option<SubjectFilter>) -> Vec<u64> {
    read_all(log, from_seq, to_seq, filter).await.iter().map(|r| r.seq).collect()
}

/// The next `count` records of a follow stream.
async fn next_records(
    stream: &mut BoxStream<'static, Result<StoredRecord, LogError>>,
    count: usize,
) -> Vec<StoredRecord> {
    let mut records = Vec::with_capacity(count);
    for _ in 0..count {
        let next = tokio::time::timeout(STEP_TIMEOUT, stream.next())
            .await
            .expect("follow produced nothing in time")
            .expect("follow stream ended")
            .expect("follow item");
        records.push(next);
    }
    records
}

async fn append_n(log: &dyn EventLog, subject: &str, prefix: &str, count: usize) -> Vec<u64> {
    let mut seqs = Vec::with_capacity(count);
    for i in 0..count {
        let outcome =
            log.append(record(subject, &format!("{prefix}-{i}"), &format!("{prefix} {i}"))).await.expect("append");
        assert!(!outcome.is_duplicate(), "{prefix}-{i} was a duplicate");
        seqs.push(outcome.seq());
    }
    seqs
}

// The checks. Each takes a fresh fixture.

async fn empty_log_has_nothing(fixture: &mut Fixture) {
    let log = fixture.log();
    assert_eq!(log.last_seq().await.expect("last_seq"), 0);
    assert_eq!(log.get(1).await.expect("get"), None);
    assert!(read_seqs(log, 1, u64::MAX, None).await.is_empty());
    assert!(!log.identity().is_empty());
}

async fn appends_get_dense_ordered_seqs(fixture: &mut Fixture) {
    let log = fixture.log();
    let subjects = [
        subjects().slack_surface("T1", "C1", None),
        subjects().agent("a1"),
        subjects().slack_surface("T1", "C1", Some("1712345678.000100")),
        subjects().config(),
        subjects().agent("a2"),
    ];
    for (i, subject) in subjects.iter().enumerate() {
        let outcome = log.append(record(subject, &format!("id-{i}"), &format!("payload {i}"))).await.expect("append");
        assert_eq!(outcome, AppendOutcome::Appended { seq: i as u64 + 1 });
    }
    assert_eq!(log.last_seq().await.expect("last_seq"), 5);
    let records = read_all(log, 1, u64::MAX, None).await;
    assert_eq!(records.len(), 5);
    for (i, stored) in records.iter().enumerate() {
        assert_eq!(stored.seq, i as u64 + 1);
        assert_eq!(stored.subject.as_str(), subjects[i]);
        assert_eq!(stored.payload, Bytes::from(format!("payload {i}")));
    }
}

async fn same_msg_id_is_a_duplicate_of_the_first(fixture: &mut Fixture) {
    let log = fixture.log();
    let subject = subjects().agent("a1");
    let first = log.append(record(&subject, "event-1", "first")).await.expect("append");
    assert_eq!(first, AppendOutcome::Appended { seq: 1 });
    log.append(record(&subject, "event-2", "second")).await.expect("append");
    // Same id, different payload and subject: still the first one, nothing new stored.
    let again = log.append(record(&subjects().config(), "event-1", "retry")).await.expect("append");
    assert_eq!(again, AppendOutcome::Duplicate { seq: 1 });
    assert_eq!(log.last_seq().await.expect("last_seq"), 2);
    let stored = log.get(1).await.expect("get").expect("seq 1 stored");
    assert_eq!(stored.payload, Bytes::from_static(b"first"));
    assert_eq!(stored.subject.as_str(), subject);
    assert_eq!(read_seqs(log, 1, u64::MAX, None).await, vec![1, 2]);
}

async fn batch_outcomes_are_in_input_order(fixture: &mut Fixture) {
    let log = fixture.log();
    let subject = subjects().agent("a1");
    assert!(log.append_batch(Vec::new()).await.expect("empty batch").is_empty());
    log.append(record(&subject, "x", "x")).await.expect("append");
    let outcomes = log
        .append_batch(vec![
            record(&subject, "a", "a"),
            record(&subject, "b", "b"),
            record(&subject, "a", "a again"),
            record(&subject, "c", "c"),
            record(&subject, "x", "x again"),
        ])
        .await
        .expect("batch");
    assert_eq!(
        outcomes,
        vec![
            AppendOutcome::Appended { seq: 2 },
            AppendOutcome::Appended { seq: 3 },
            AppendOutcome::Duplicate { seq: 2 },
            AppendOutcome::Appended { seq: 4 },
            AppendOutcome::Duplicate { seq: 1 },
        ]
    );

    // A batch far larger than the ack window / group commit bound, with repeats spread out.
    let large: Vec<AppendRecord> =
        (0..1000).map(|i| record(&subject, &format!("large-{}", i % 900), &format!("{i}"))).collect();
    let outcomes = log.append_batch(large).await.expect("large batch");
    assert_eq!(outcomes.len(), 1000);
    for (i, outcome) in outcomes.iter().enumerate() {
        let expected_seq = 5 + (i % 900) as u64;
        if i < 900 {
            assert_eq!(*outcome, AppendOutcome::Appended { seq: expected_seq });
        } else {
            assert_eq!(*outcome, AppendOutcome::Duplicate { seq: expected_seq });
        }
    }
    assert_eq!(log.last_seq().await.expect("last_seq"), 904);
    let stored = log.get(904).await.expect("get").expect("seq 904");
    assert_eq!(stored.payload, Bytes::from_static(b"899"));
}

async fn concurrent_appends_get_distinct_dense_seqs(fixture: &mut Fixture) {
    let log = fixture.shared_log();
    let writers = 8;
    let appends_per_writer = 100;
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let log = Arc::clone(&log);
        tasks.push(tokio::spawn(async move {
            let subject = subjects().agent(&format!("a{writer}"));
            append_n(log.as_ref(), &subject, &format!("w{writer}"), appends_per_writer).await
        }));
    }
    let mut seqs = Vec::new();
    for task in tasks {
        let writer_seqs = task.await.expect("writer task");
        // One writer's appends are ordered among themselves.
        assert!(writer_seqs.windows(2).all(|pair| pair[0] < pair[1]));
        seqs.extend(writer_seqs);
    }
    seqs.sort_unstable();
    let total = (writers * appends_per_writer) as u64;
    assert_eq!(seqs, (1..=total).collect::<Vec<_>>());
    assert_eq!(log.last_seq().await.expect("last_seq"), total);
    assert_eq!(read_seqs(log.as_ref(), 1, u64::MAX, None).await, (1..=total).collect::<Vec<_>>());
}

async fn ranges_and_filters(fixture: &mut Fixture) {
    let log = fixture.log();
    let channel = subjects().slack_surface("T1", "C1", None);
    let thread = subjects().slack_surface("T1", "C1", Some("1712345678.000100"));
    let a1 = subjects().agent("a1");
    let a2 = subjects().agent("a2");
    // seq:        1         2    3        4    5        6    7        8       9        10
    let subjects = [&channel, &a1, &thread, &a2, &channel, &a2, &thread, &channel, &a2, &channel];
    for (i, subject) in subjects.iter().enumerate() {
        log.append(record(subject, &format!("r{i}"), "x")).await.expect("append");
    }

    assert_eq!(read_seqs(log, 3, 6, None).await, vec![3, 4, 5, 6]);
    assert_eq!(read_seqs(log, 0, u64::MAX, None).await, (1..=10).collect::<Vec<_>>());
    assert_eq!(read_seqs(log, 8, 100, None).await, vec![8, 9, 10]);
    assert_eq!(read_seqs(log, 10, 10, None).await, vec![10]);
    assert!(read_seqs(log, 11, 20, None).await.is_empty());
    assert!(read_seqs(log, 6, 5, None).await.is_empty());

    // `*` matches one token, `>` one or more.
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.agent.*")).await, vec![2, 4, 6, 9]);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.surface.slack.T1.C1")).await, vec![1, 5, 8, 10]);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.surface.>")).await, vec![1, 3, 5, 7, 8, 10]);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.surface.slack.*.*.thread.*")).await, vec![3, 7]);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.>")).await, (1..=10).collect::<Vec<_>>());
    assert_eq!(read_seqs(log, 4, 8, filter("anima.v1.agent.*")).await, vec![4, 6]);

    // Termination: nothing matches; the last match is below `to_seq`; matches only above it.
    assert!(read_seqs(log, 1, u64::MAX, filter("anima.v1.nothing.>")).await.is_empty());
    assert!(read_seqs(log, 1, u64::MAX, filter("elsewhere.>")).await.is_empty());
    assert_eq!(read_seqs(log, 1, 10, filter(&a1)).await, vec![2]);
    assert_eq!(read_seqs(log, 3, 1_000, filter(&a1)).await, Vec::<u64>::new());
    assert!(read_seqs(log, 1, 3, filter("anima.v1.agent.a2")).await.is_empty());

    // A read ends at the last event stored when it was called, even if more arrive meanwhile.
    let mut stream = log.read(1, u64::MAX, None).await.expect("read");
    log.append(record(&a1, "late", "late")).await.expect("append");
    let mut seqs = Vec::new();
    while let Some(next) = tokio::time::timeout(STEP_TIMEOUT, stream.next()).await.expect("read did not terminate") {
        seqs.push(next.expect("read item").seq);
    }
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());

    assert!(matches!(log.read(1, 10, filter("anima..v1")).await.map(|_| ()), Err(LogError::Invalid(_))));
}

async fn follow_sees_existing_then_live(fixture: &mut Fixture) {
    let log = fixture.shared_log();
    let a1 = subjects().agent("a1");
    let a2 = subjects().agent("a2");
    append_n(log.as_ref(), &a1, "before", 3).await;

    let mut everything = log.follow(2, None).await.expect("follow");
    let mut only_a2 = log.follow(1, filter(&a2)).await.expect("follow");
    let mut from_the_end = log.follow(4, None).await.expect("follow");
    let existing = next_records(&mut everything, 2).await;
    assert_eq!(existing.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![2, 3]);

    // Live appends from another task while the followers wait.
    let writer = {
        let log = Arc::clone(&log);
        let (a1, a2) = (a1.clone(), a2.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            log.append(record(&a2, "live-0", "live 0")).await.expect("append");
            log.append(record(&a1, "live-1", "live 1")).await.expect("append");
            log.append(record(&a2, "live-2", "live 2")).await.expect("append");
        })
    };
    let live = next_records(&mut everything, 3).await;
    assert_eq!(live.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4, 5, 6]);
    assert_eq!(live[0].payload, Bytes::from_static(b"live 0"));
    let filtered = next_records(&mut only_a2, 2).await;
    assert_eq!(filtered.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4, 6]);
    assert!(filtered.iter().all(|r| r.subject.as_str() == a2));
    let tail = next_records(&mut from_the_end, 3).await;
    assert_eq!(tail.iter().map(|r| r.seq).collect::<Vec<_>>(), vec![4, 5, 6]);
    writer.await.expect("writer task");

    // Nothing more arrives: the follower waits rather than ending.
    let idle = tokio::time::timeout(Duration::from_millis(200), everything.next()).await;
    assert!(idle.is_err(), "follow yielded or ended without a new event");
}

async fn get_returns_stored_events(fixture: &mut Fixture) {
    let log = fixture.log();
    let subject = subjects().agent("a1");
    append_n(log, &subject, "g", 3).await;
    assert_eq!(log.get(0).await.expect("get 0"), None);
    assert_eq!(log.get(4).await.expect("get 4"), None);
    assert_eq!(log.get(1_000_000).await.expect("get far"), None);
    let read = read_all(log, 1, 3, None).await;
    for expected in read {
        let got = log.get(expected.seq).await.expect("get").expect("stored");
        // Same seq, subject, payload and the same log timestamp as a read returns.
        assert_eq!(got, expected);
    }
}

async fn timestamps_are_the_logs_and_monotonic(fixture: &mut Fixture) {
    let log = fixture.log();
    let before = now_ns();
    let subject = subjects().agent("a1");
    append_n(log, &subject, "single", 20).await;
    let batch: Vec<AppendRecord> = (0..200).map(|i| record(&subject, &format!("batch-{i}"), "b")).collect();
    log.append_batch(batch).await.expect("batch");
    append_n(log, &subject, "after", 5).await;
    let after = now_ns();

    let records = read_all(log, 1, u64::MAX, None).await;
    assert_eq!(records.len(), 225);
    let slack_ns = Duration::from_secs(5).as_nanos() as i64;
    for pair in records.windows(2) {
        assert!(
            pair[0].timestamp_ns <= pair[1].timestamp_ns,
            "timestamp went back between seq {} and {}",
            pair[0].seq,
            pair[1].seq
        );
    }
    for stored in &records {
        assert!(
            stored.timestamp_ns >= before - slack_ns && stored.timestamp_ns <= after + slack_ns,
            "seq {} stamped {} outside [{before}, {after}]",
            stored.seq,
            stored.timestamp_ns
        );
    }
}

async fn invalid_records_are_refused(fixture: &mut Fixture) {
    let log = fixture.log();
    let refused = [
        record("anima.v1.agent.*", "id", "wildcard"),
        record("other.subject", "id", "outside anima.v1"),
        record("anima.v1..x", "id", "empty token"),
        record(&subjects().agent("a1"), "", "empty msg id"),
        record(&subjects().agent("a1"), "has space", "whitespace msg id"),
        AppendRecord {
            subject: subjects().agent("a1"),
            msg_id: "too-big".into(),
            payload: Bytes::from(vec![0u8; anima_engine::log::PAYLOAD_BYTES_MAX + 1]),
        },
    ];
    for bad in refused {
        let single = log.append(bad.clone()).await;
        assert!(matches!(single, Err(LogError::Invalid(_))), "{:?} gave {single:?}", bad.subject);
        let batch = log.append_batch(vec![record(&subjects().agent("a1"), "fine", "ok"), bad]).await;
        assert!(matches!(batch, Err(LogError::Invalid(_))), "{batch:?}");
    }
    // A refused batch stores nothing, not even its valid records.
    assert_eq!(log.last_seq().await.expect("last_seq"), 0);
}

async fn everything_acknowledged_survives_reopen(fixture: &mut Fixture) {
    let identity = fixture.log().identity();
    let subject = subjects().agent("a1");
    let batch: Vec<AppendRecord> =
        (0..50).map(|i| record(&subject, &format!("p-{i}"), &format!("payload {i}"))).collect();
    fixture.log().append_batch(batch).await.expect("batch");
    append_n(fixture.log(), &subject, "single", 5).await;
    let before = read_all(fixture.log(), 1, u64::MAX, None).await;
    assert_eq!(before.len(), 55);

    fixture.reopen().await;

    let log = fixture.log();
    assert_eq!(log.identity(), identity, "identity changed across reopen");
    assert_eq!(log.last_seq().await.expect("last_seq"), 55);
    assert_eq!(read_all(log, 1, u64::MAX, None).await, before);
    // Dedupe state survives too, and seqs and timestamps continue from where they were.
    let again = log.append(record(&subject, "p-7", "retry")).await.expect("append");
    assert_eq!(again, AppendOutcome::Duplicate { seq: 8 });
    let next = log.append(record(&subject, "after-reopen", "new")).await.expect("append");
    assert_eq!(next, AppendOutcome::Appended { seq: 56 });
    let newest = log.get(56).await.expect("get").expect("seq 56");
    assert!(newest.timestamp_ns >= before[54].timestamp_ns);
}

async fn ids_stay_readable_in_subjects_across_reopen(fixture: &mut Fixture) {
    let subject = fixture.log().subjects().agent("ada_bot");
    assert_eq!(subject, "anima.v1.agent.ada_bot");
    let chat = fixture.log().subjects().chat_surface("t1", "oc_abc", Some("ou_x.1"));
    assert_eq!(chat, "anima.v1.surface.chat.t1.oc_abc.thread.ou_x%2E1");
    fixture.log().append(record(&subject, "readable", "x")).await.expect("append");
    fixture.log().append(record(&chat, "readable-chat", "x")).await.expect("append");
    fixture.reopen().await;
    let log = fixture.log();
    // The log keeps the encoding it was created with.
    assert_eq!(log.subjects().encoding(), SubjectEncoding::NEWEST);
    assert_eq!(log.subjects().agent("ada_bot"), subject);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter(&subject)).await, vec![1]);
    assert_eq!(read_seqs(log, 1, u64::MAX, filter("anima.v1.surface.chat.t1.oc_abc.thread.*")).await, vec![2]);
}

/// Instantiates every check for both backends: `conformance::embedded::<check>` and
/// `conformance::jetstream::<check>`.
macro_rules! conformance_suite {
    ($($check:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let mut fixture = super::Fixture::embedded();
                    super::$check(&mut fixture).await;
                }
            )*
        }

        mod jetstream {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    let mut fixture = super::Fixture::jetstream().await;
                    super::$check(&mut fixture).await;
                }
            )*
        }
    };
}

conformance_suite!(
    empty_log_has_nothing,
    appends_get_dense_ordered_seqs,
    same_msg_id_is_a_duplicate_of_the_first,
    batch_outcomes_are_in_input_order,
    concurrent_appends_get_distinct_dense_seqs,
    ranges_and_filters,
    follow_sees_existing_then_live,
    get_returns_stored_events,
    timestamps_are_the_logs_and_monotonic,
    invalid_records_are_refused,
    everything_acknowledged_survives_reopen,
    ids_stay_readable_in_subjects_across_reopen,
);

/// What only the JetStream backend has: a stream created by someone else, a server that is not
/// there, a follower that lives through a server restart.
mod jetstream_only {
    use super::*;
    use async_nats::jetstream::stream::{Config, StorageType};

    /// As NATS users see the stream: created append-only (deletes and purges refused by the
    /// server), and every message names its event type in a header, so `nats stream view` and
    /// consumers filter without decoding.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_stream_is_append_only_and_messages_name_their_event_type() {
        let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
        let log = JetStreamLog::connect(JetStreamConfig { url: server.url(), ..JetStreamConfig::default() })
            .await
            .expect("connect");
        let registration = anima_projections::proto::Envelope {
            event_id: "e1".into(),
            min_reader_version: 1,
            payload: Some(anima_projections::proto::envelope::Payload::AgentRegistered(
                anima_projections::proto::AgentRegistered { agent_id: "ada".into(), ..Default::default() },
            )),
            ..Default::default()
        };
        let payload = Bytes::from(prost::Message::encode_to_vec(&registration));
        let subject = subjects().agent("ada");
        log.append(AppendRecord { subject, msg_id: "e1".into(), payload }).await.expect("append");

        let client = async_nats::connect(server.url()).await.expect("connect");
        let mut stream = async_nats::jetstream::new(client).get_stream("ANIMA").await.expect("stream");
        let config = stream.info().await.expect("info").config.clone();
        assert!(config.deny_delete && config.deny_purge, "{config:?}");
        let stored = stream.get_raw_message(1).await.expect("message 1");
        let event_type = stored.headers.get(anima_engine::log::jetstream::EVENT_TYPE_HEADER).map(|v| v.to_string());
        assert_eq!(event_type.as_deref(), Some("agent_registered"));
        assert!(stream.purge().await.is_err(), "a purge is refused by the server");
        assert!(stream.delete_message(1).await.is_err(), "a delete is refused by the server");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_incompatible_existing_stream_is_refused() {
        let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
        let client = async_nats::connect(server.url()).await.expect("connect");
        let context = async_nats::jetstream::new(client);
        context
            .create_stream(Config {
                name: "ANIMA".into(),
                subjects: vec!["anima.v1.>".into()],
                storage: StorageType::Memory,
                duplicate_window: Duration::from_secs(120),
                ..Config::default()
            })
            .await
            .expect("create stream");
        let refused = JetStreamLog::connect(JetStreamConfig { url: server.url(), ..JetStreamConfig::default() }).await;
        match refused {
            Err(LogError::Store(message)) => {
                assert!(message.contains("storage"), "{message}");
                assert!(message.contains("duplicate window"), "{message}");
            }
            other => panic!("expected a Store error, got {other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unreachable_server_is_unavailable() {
        let server = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
        let url = server.url();
        drop(server);
        let result = JetStreamLog::connect(JetStreamConfig {
            url,
            request_timeout: Duration::from_secs(1),
            ..JetStreamConfig::default()
        })
        .await;
        assert!(matches!(result, Err(LogError::Unavailable(_))), "{result:?}");
    }

    /// A follower is polled all the time in real use (the projection runner awaits it), so it
    /// sees the disconnect and the ordered consumer recreates itself from the last delivered seq.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_follower_lives_through_a_server_restart() {
        let mut fixture = Fixture::jetstream().await;
        let log = fixture.shared_log();
        let subject = subjects().agent("a1");
        append_n(log.as_ref(), &subject, "before", 2).await;
        let mut follower = log.follow(1, None).await.expect("follow");
        let (seqs_tx, mut seqs_rx) = tokio::sync::mpsc::unbounded_channel();
        let follower_task = tokio::spawn(async move {
            while let Some(next) = follower.next().await {
                if seqs_tx.send(next.map(|r| r.seq)).is_err() {
                    break;
                }
            }
        });
        for expected in 1..=2 {
            let seq = tokio::time::timeout(STEP_TIMEOUT, seqs_rx.recv()).await;
            assert_eq!(seq.expect("in time").expect("open").expect("record"), expected);
        }

        let Backend::JetStream { server, .. } = &mut fixture.backend else {
            unreachable!("jetstream fixture");
        };
        tokio::task::block_in_place(|| server.restart());
        let restarted = tokio::time::Instant::now();

        // The client reconnects by itself; retry the append (same msg id) until it does.
        let outcome = loop {
            match log.append(record(&subject, "after-restart", "x")).await {
                Ok(outcome) => break outcome,
                Err(LogError::Unavailable(_)) if restarted.elapsed() < STEP_TIMEOUT => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("append after restart: {e}"),
            }
        };
        assert_eq!(outcome.seq(), 3);
        let resumed = tokio::time::timeout(Duration::from_secs(20), seqs_rx.recv()).await;
        assert_eq!(resumed.expect("in time").expect("open").expect("record"), 3);
        follower_task.abort();
    }
}
