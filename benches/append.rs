//! Append throughput of both log backends through the `EventLog` trait, each next to the raw
//! store doing the same writes on the same machine, so the ratio shows what the log layer costs:
//!
//! * embedded: `EmbeddedLog::append_batch` of 1,000 records against raw sled `apply_batch` +
//!   `flush` of the same entries (the records in groups of the same bounds under their first
//!   seq's key, byte for byte the same sizes; the embedded log keeps its msg ids in memory, so
//!   neither side writes an index of them) in a tree of the same kind. The raw side does not
//!   read or hash: the embedded log also looks each msg id up in its in-memory window (dedupe)
//!   and reads the record at its pruning's position. The run is shorter than the dedupe window,
//!   so nothing is pruned on either side.
//! * JetStream: `JetStreamLog::append_batch` of 10,000 records against raw async-nats publishes
//!   of the same subjects, payloads and `Nats-Msg-Id` headers into the same stream, with the
//!   same window of acks in flight (`JetStreamConfig::default().ack_window`) polled together in
//!   a `FuturesUnordered`, on a connection with the same async-nats ack limit.
//!
//! Criterion measures each side on its own. The printed ratio comes from a second phase that
//! alternates engine and raw batches ([`crate::measure::interleave`]): measured one after the
//! other, the two sides saw different machines (other builds come and go), which moved the ratio
//! by ±40% between runs.
//!
//! Records are ~300-byte encoded Slack observations on 64 channel subjects; every msg id is
//! distinct across the run (36 bytes, the length of the engine's UUID ids), so nothing dedupes.

use std::time::{Duration, Instant};

use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{AppendOutcome, AppendRecord, EventLog};
use anima_engine::subject::{SubjectPrefix, Subjects};
use anima_engine::testing::NatsServer;
use anima_projections::proto::{self, envelope::Payload};
use bytes::Bytes;
use criterion::{Criterion, SamplingMode, Throughput};
use futures::stream::{FuturesUnordered, StreamExt};
use prost::Message;
use tokio::runtime::Runtime;

use crate::measure::{interleave, median, Interleaved, Side};

/// Records per `append_batch` against the embedded log (and per raw sled batch).
const EMBEDDED_BATCH_RECORDS: usize = 1_000;
/// Records per `append_batch` against JetStream: ten ack windows, so the pipeline is full most of
/// the time.
const JETSTREAM_BATCH_RECORDS: usize = 10_000;
/// Interleaved batch pairs (one engine batch, one raw batch) behind the printed ratio.
const EMBEDDED_ROUNDS: usize = 30;
const JETSTREAM_ROUNDS: usize = 10;
/// Target size of one encoded payload.
const PAYLOAD_BYTES: usize = 300;
const CHANNELS: usize = 64;
/// Distinct payloads cycled through (cloning `Bytes` is a reference count).
const PAYLOADS_DISTINCT: usize = 256;
const TEAM: &str = "T0AB12CD3";

/// Same layout constants as the embedded log's tree (`crates/engine/src/log/embedded.rs`).
const PREFIX_GROUP: u8 = b'g';
/// Metadata (stream identity, layout): written once, not per batch.
const PREFIX_META: u8 = b'x';
const RECORD_VERSION: u8 = 1;
const GROUP_VERSION: u8 = 1;
const GROUP_RECORDS_MAX: usize = 64;
const GROUP_BYTES_MAX: usize = 16 * 1024;

/// Makes batches of distinct records: subjects and payloads cycle, msg ids never repeat.
struct RecordSource {
    /// Four bytes, so every id is 36 bytes long whatever the source.
    msg_id_prefix: &'static str,
    next: u64,
    subjects: Vec<String>,
    payloads: Vec<Bytes>,
}

impl RecordSource {
    fn new(msg_id_prefix: &'static str) -> Self {
        assert_eq!(msg_id_prefix.len(), 4);
        let subjects = (0..CHANNELS)
            .map(|c| Subjects::newest(SubjectPrefix::default()).slack_surface(TEAM, &format!("C{c:08}"), None))
            .collect();
        let payloads = (0..PAYLOADS_DISTINCT).map(|i| Bytes::from(payload(i, PAYLOAD_BYTES))).collect();
        RecordSource { msg_id_prefix, next: 0, subjects, payloads }
    }

    fn batch(&mut self, records: usize) -> Vec<AppendRecord> {
        (0..records)
            .map(|_| {
                let n = self.next;
                self.next += 1;
                AppendRecord {
                    subject: self.subjects[n as usize % CHANNELS].clone(),
                    msg_id: format!("{}{n:032}", self.msg_id_prefix),
                    payload: self.payloads[n as usize % PAYLOADS_DISTINCT].clone(),
                }
            })
            .collect()
    }
}

/// An encoded Slack message observation of about `bytes` bytes.
fn payload(index: usize, bytes: usize) -> Vec<u8> {
    let mut envelope = proto::Envelope {
        event_id: format!("{index:08x}-0000-7000-8000-000000000000"),
        occurred_at_ms: 1_700_000_000_000 + index as i64,
        min_reader_version: 1,
        source: "slack-connector".into(),
        payload: Some(Payload::SlackMessage(proto::SlackMessageObserved {
            receiving_agent_id: "agent-0".into(),
            kind: proto::SlackDeliveryKind::Message as i32,
            team_id: TEAM.into(),
            channel_id: format!("C{:08}", index % CHANNELS),
            ts: format!("1700000000.{index:06}"),
            user_id: "U00000042".into(),
            user_name: "Person 42".into(),
            ..Default::default()
        })),
    };
    let without_text = envelope.encoded_len();
    // Two bytes of tag and length for the text field.
    let text_bytes = bytes.saturating_sub(without_text + 2);
    if let Some(Payload::SlackMessage(message)) = envelope.payload.as_mut() {
        message.text = "lorem ipsum ".repeat(text_bytes / 12 + 1)[..text_bytes].to_owned();
    }
    envelope.encode_to_vec()
}

/// The raw baseline of the embedded log: the same entries (records in groups), one
/// `apply_batch`, one `flush`.
fn raw_sled_append(tree: &sled::Tree, records: &[AppendRecord], last_seq: &mut u64, timestamp_ns: i64) {
    let mut batch = sled::Batch::default();
    let mut group: Vec<u8> = Vec::new();
    let (mut group_first, mut group_records) = (0u64, 0usize);
    for record in records {
        *last_seq += 1;
        let seq = *last_seq;
        let subject = record.subject.as_bytes();
        let msg_id = record.msg_id.as_bytes();
        let len = 1 + 8 + 4 + subject.len() + 2 + msg_id.len() + record.payload.len();
        if group_records == GROUP_RECORDS_MAX || (group_records > 0 && group.len() + 4 + len > GROUP_BYTES_MAX) {
            batch.insert(&group_key(group_first)[..], std::mem::take(&mut group));
            group_records = 0;
        }
        if group_records == 0 {
            group_first = seq;
            group.push(GROUP_VERSION);
        }
        group.extend_from_slice(&(len as u32).to_be_bytes());
        group.push(RECORD_VERSION);
        group.extend_from_slice(&timestamp_ns.to_be_bytes());
        group.extend_from_slice(&(subject.len() as u32).to_be_bytes());
        group.extend_from_slice(subject);
        group.extend_from_slice(&(msg_id.len() as u16).to_be_bytes());
        group.extend_from_slice(msg_id);
        group.extend_from_slice(&record.payload);
        group_records += 1;
    }
    if group_records > 0 {
        batch.insert(&group_key(group_first)[..], group);
    }
    tree.apply_batch(batch).expect("raw sled apply_batch");
    tree.flush().expect("raw sled flush");
}

/// The entries of a log tree other than its metadata (groups, and any index a build would write
/// per record): how many, and their keys' and values' bytes.
fn appended_entries(tree: &sled::Tree) -> (usize, usize) {
    tree.iter()
        .map(|entry| entry.expect("read an entry"))
        .filter(|(k, _)| k.first() != Some(&PREFIX_META))
        .fold((0, 0), |(n, bytes), (k, v)| (n + 1, bytes + k.len() + v.len()))
}

fn group_key(first_seq: u64) -> [u8; 9] {
    let mut key = [0u8; 9];
    key[0] = PREFIX_GROUP;
    key[1..].copy_from_slice(&first_seq.to_be_bytes());
    key
}

fn assert_all_appended(outcomes: &[AppendOutcome], expected: usize) {
    assert_eq!(outcomes.len(), expected);
    assert!(outcomes.iter().all(|o| !o.is_duplicate()), "distinct msg ids must not dedupe");
}

fn unix_ns() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

/// The summary line of an interleaved comparison: rates from the median batch time of each side.
fn ratio_line(name: &str, baseline_name: &str, batch_records: usize, runs: &Interleaved, detail: &str) -> String {
    let engine = batch_records as f64 / median(&runs.engine).as_secs_f64();
    let baseline = batch_records as f64 / median(&runs.raw).as_secs_f64();
    format!(
        "{name}: {engine:.0} ev/s, {baseline_name}: {baseline:.0} ev/s, ratio {:.2} ({detail}; median of {} interleaved batches each)",
        engine / baseline,
        runs.engine.len()
    )
}

/// Both sides of the embedded comparison, opened on first use.
struct EmbeddedFixture {
    log: EmbeddedLog,
    engine_source: RecordSource,
    raw_tree: sled::Tree,
    raw_source: RecordSource,
    raw_last_seq: u64,
    _directory: tempfile::TempDir,
}

impl EmbeddedFixture {
    /// Opens both sides and appends one batch to each: the raw baseline copies the embedded
    /// log's group encoding and bounds (they are private to it), so the two trees' entries are
    /// compared before anything is measured, and a change to either fails here instead of
    /// skewing the ratio.
    fn open(runtime: &Runtime) -> Self {
        let directory = tempfile::Builder::new().prefix("anima-bench-sled-").tempdir().expect("temporary directory");
        let db = sled::Config::new().path(directory.path().join("embedded")).open().expect("open sled");
        let engine_tree = db.open_tree("log").expect("the embedded log's tree");
        let log = EmbeddedLog::open(db, EmbeddedConfig::default()).expect("open the embedded log");
        let db = sled::Config::new().path(directory.path().join("raw")).open().expect("open sled");
        let raw_tree = db.open_tree("log").expect("open tree");
        let mut fixture = EmbeddedFixture {
            log,
            engine_source: RecordSource::new("emb-"),
            raw_tree,
            raw_source: RecordSource::new("raw-"),
            raw_last_seq: 0,
            _directory: directory,
        };
        fixture.engine_batch(runtime);
        fixture.raw_batch();
        assert_eq!(
            appended_entries(&engine_tree),
            appended_entries(&fixture.raw_tree),
            "entries (count, bytes) of one batch: the raw baseline no longer writes what the embedded log writes"
        );
        fixture
    }

    /// Appends one batch through the `EventLog` trait; returns the time the append took.
    fn engine_batch(&mut self, runtime: &Runtime) -> Duration {
        let batch = self.engine_source.batch(EMBEDDED_BATCH_RECORDS);
        let started = Instant::now();
        let outcomes = runtime.block_on(self.log.append_batch(batch)).expect("embedded append_batch");
        let elapsed = started.elapsed();
        assert_all_appended(&outcomes, EMBEDDED_BATCH_RECORDS);
        elapsed
    }

    /// Writes the same entries of one batch to raw sled; returns the time it took.
    fn raw_batch(&mut self) -> Duration {
        let batch = self.raw_source.batch(EMBEDDED_BATCH_RECORDS);
        let started = Instant::now();
        raw_sled_append(&self.raw_tree, &batch, &mut self.raw_last_seq, unix_ns());
        started.elapsed()
    }
}

/// Times `batch` once per criterion iteration.
fn iterate(iters: u64, mut batch: impl FnMut() -> Duration) -> Duration {
    (0..iters).map(|_| batch()).sum()
}

/// The embedded log against raw sled. Returns the summary line, or `None` when filtered out.
pub fn bench_embedded(c: &mut Criterion, runtime: &Runtime, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("embedded_append");
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::Elements(EMBEDDED_BATCH_RECORDS as u64));
    let mut fixture: Option<EmbeddedFixture> = None;
    group.bench_function("event_log_append_batch", |b| {
        let fixture = fixture.get_or_insert_with(|| EmbeddedFixture::open(runtime));
        b.iter_custom(|iters| iterate(iters, || fixture.engine_batch(runtime)));
    });
    group.bench_function("raw_sled_apply_batch_flush", |b| {
        let fixture = fixture.get_or_insert_with(|| EmbeddedFixture::open(runtime));
        b.iter_custom(|iters| iterate(iters, || fixture.raw_batch()));
    });
    group.finish();

    let mut fixture = fixture?;
    let rounds = if quick { 2 } else { EMBEDDED_ROUNDS };
    let runs = interleave(rounds, |side| match side {
        Side::Engine => fixture.engine_batch(runtime),
        Side::Raw => fixture.raw_batch(),
    });
    Some(ratio_line(
        "embedded_append",
        "raw sled",
        EMBEDDED_BATCH_RECORDS,
        &runs,
        &format!("batches of {EMBEDDED_BATCH_RECORDS} × ~{PAYLOAD_BYTES} B, records grouped as the embedded log groups them, one flush per batch"),
    ))
}

/// Raw async-nats: publish every record with its `Nats-Msg-Id`, at most `window` acks in flight,
/// polled together.
async fn raw_publish_batch(
    context: &async_nats::jetstream::Context,
    records: Vec<AppendRecord>,
    window: usize,
) -> usize {
    let mut in_flight = FuturesUnordered::new();
    let mut acked = 0usize;
    let mut check = |ack: Result<async_nats::jetstream::publish::PublishAck, _>| {
        let ack = ack.expect("raw publish ack");
        assert!(!ack.duplicate, "distinct msg ids must not dedupe");
        acked += 1;
    };
    for record in records {
        while in_flight.len() >= window {
            if let Some(ack) = in_flight.next().await {
                check(ack);
            }
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", record.msg_id.as_str());
        let ack = context.publish_with_headers(record.subject, headers, record.payload).await.expect("raw publish");
        in_flight.push(async move { ack.await });
    }
    while let Some(ack) = in_flight.next().await {
        check(ack);
    }
    acked
}

/// Both sides of the JetStream comparison on one server, started on first use.
struct JetStreamFixture {
    log: JetStreamLog,
    engine_source: RecordSource,
    raw: async_nats::jetstream::Context,
    raw_source: RecordSource,
    ack_window: usize,
    // Dropped last: stops nats-server.
    _server: NatsServer,
}

impl JetStreamFixture {
    fn start(runtime: &Runtime) -> Self {
        let server = NatsServer::start();
        let config = JetStreamConfig { url: server.url(), ..JetStreamConfig::default() };
        runtime.block_on(async {
            let log = JetStreamLog::connect(config.clone()).await.expect("connect the JetStream log");
            let client = async_nats::connect(server.url()).await.expect("connect raw client");
            // The same ack limit and backpressure as the engine's connection (4 × ack_window).
            let raw = async_nats::jetstream::ContextBuilder::new()
                .timeout(config.request_timeout)
                .max_ack_inflight(config.ack_window * 4)
                .backpressure_on_inflight(true)
                .build(client);
            JetStreamFixture {
                log,
                engine_source: RecordSource::new("eng-"),
                raw,
                raw_source: RecordSource::new("raw-"),
                ack_window: config.ack_window,
                _server: server,
            }
        })
    }

    fn engine_batch(&mut self, runtime: &Runtime) -> Duration {
        let batch = self.engine_source.batch(JETSTREAM_BATCH_RECORDS);
        let started = Instant::now();
        let outcomes = runtime.block_on(self.log.append_batch(batch)).expect("JetStream append_batch");
        let elapsed = started.elapsed();
        assert_all_appended(&outcomes, JETSTREAM_BATCH_RECORDS);
        elapsed
    }

    fn raw_batch(&mut self, runtime: &Runtime) -> Duration {
        let batch = self.raw_source.batch(JETSTREAM_BATCH_RECORDS);
        let started = Instant::now();
        let acked = runtime.block_on(raw_publish_batch(&self.raw, batch, self.ack_window));
        let elapsed = started.elapsed();
        assert_eq!(acked, JETSTREAM_BATCH_RECORDS);
        elapsed
    }
}

/// The JetStream log against raw async-nats. Returns the summary line, or `None` when filtered
/// out.
pub fn bench_jetstream(c: &mut Criterion, runtime: &Runtime, quick: bool) -> Option<String> {
    let mut group = c.benchmark_group("jetstream_append");
    group.sampling_mode(SamplingMode::Flat);
    group.throughput(Throughput::Elements(JETSTREAM_BATCH_RECORDS as u64));
    let mut fixture: Option<JetStreamFixture> = None;
    group.bench_function("event_log_append_batch", |b| {
        let fixture = fixture.get_or_insert_with(|| JetStreamFixture::start(runtime));
        b.iter_custom(|iters| iterate(iters, || fixture.engine_batch(runtime)));
    });
    group.bench_function("raw_async_nats_publish", |b| {
        let fixture = fixture.get_or_insert_with(|| JetStreamFixture::start(runtime));
        b.iter_custom(|iters| iterate(iters, || fixture.raw_batch(runtime)));
    });
    group.finish();

    let mut fixture = fixture?;
    let rounds = if quick { 2 } else { JETSTREAM_ROUNDS };
    let runs = interleave(rounds, |side| match side {
        Side::Engine => fixture.engine_batch(runtime),
        Side::Raw => fixture.raw_batch(runtime),
    });
    Some(ratio_line(
        "jetstream_append",
        "raw async-nats",
        JETSTREAM_BATCH_RECORDS,
        &runs,
        &format!(
            "batches of {JETSTREAM_BATCH_RECORDS} × ~{PAYLOAD_BYTES} B with Nats-Msg-Id, {} acks in flight",
            fixture.ack_window
        ),
    ))
}
