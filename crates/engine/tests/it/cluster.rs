//! JetStream in production shape: a server list instead of one URL, and (with the 3-node
//! fixture of `anima_engine::testing`) failover of the stream leader under load.

use std::sync::Arc;
use std::time::Duration;

use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{AppendRecord, EventLog, LogError, StoredRecord};
use anima_engine::subject::{SubjectPrefix, Subjects};
use anima_engine::testing::{poll_reporting, poll_until, stream_view, NatsCluster, NatsServer, CLUSTER_STEP_DEADLINE};
use bytes::Bytes;
use futures::StreamExt;

/// The subjects of the fresh logs these tests append to: the default prefix and the newest
/// encoding.
fn subjects() -> Subjects {
    Subjects::newest(SubjectPrefix::default())
}

fn record(msg_id: &str) -> AppendRecord {
    AppendRecord { subject: subjects().agent("a1"), msg_id: msg_id.to_owned(), payload: Bytes::from_static(b"x") }
}

/// A server list whose first entry is down still connects: an engine restarted while one node
/// of its cluster is away can start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_list_connects_past_a_server_that_is_down() {
    let down = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
    let down_url = down.url();
    drop(down);
    let up = tokio::task::spawn_blocking(NatsServer::start).await.expect("nats-server start task");
    let config = JetStreamConfig {
        url: format!("{down_url}, {}", up.url()),
        request_timeout: Duration::from_secs(2),
        ..JetStreamConfig::default()
    };
    // The client shuffles the list, so connect a few times to meet the dead server first.
    for attempt in 0..4 {
        let log = JetStreamLog::connect(config.clone()).await.expect("connects to the server that is up");
        let outcome = log.append(record(&format!("m{attempt}"))).await.expect("append");
        assert_eq!(outcome.seq(), attempt + 1);
    }
}

/// A malformed list is a configuration error naming the entry, never "unavailable" (which
/// callers retry).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_server_list_is_a_configuration_error() {
    for (list, named) in [
        ("nats://127.0.0.1:4222,nats://127.0.0.1:99999", "\"nats://127.0.0.1:99999\""),
        ("nats://127.0.0.1:4222,,nats://127.0.0.1:4223", "server 2 of 3 is empty"),
        ("http://127.0.0.1:4222", "\"http://127.0.0.1:4222\""),
    ] {
        let config = JetStreamConfig { url: list.to_owned(), ..JetStreamConfig::default() };
        match JetStreamLog::connect(config).await {
            Err(LogError::Store(message)) => {
                assert!(message.contains("NATS server list"), "{message}");
                assert!(message.contains(named), "{list:?} gave {message}");
            }
            other => panic!("{list:?}: expected a configuration error, got {other:?}"),
        }
    }
}

/// Events appended across the failovers. Each step lets the writer run up to
/// [`WRITER_SLACK_EVENTS`] ahead of it, so what is left after the last kill's step and the
/// step-down's must still hold the batches the freeze step waits for (checked there).
const FAILOVER_EVENTS: usize = 70_000;
/// Events per `append_batch` (one connector's burst).
const FAILOVER_BATCH: usize = 1_000;
/// The stream leader is killed once this many events were acknowledged, then once more for each
/// further entry; the killed node comes back (same store) before the next kill.
const KILL_AFTER_ACKNOWLEDGED: [usize; 3] = [10_000, 25_000, 40_000];
/// Events the writer may run ahead of the test's next step, so appends are in flight at every
/// kill whatever the machine's speed.
const WRITER_SLACK_EVENTS: usize = 10_000;
/// Pause between two attempts of a batch that failed `Unavailable` (a connector's retry pace).
const RETRY_PAUSE: Duration = Duration::from_millis(50);

/// What the writer saw: the acknowledged seq of every event, and when each batch completed.
struct Written {
    acknowledged: Vec<u64>,
    batch_done_at: Vec<tokio::time::Instant>,
    failed_attempts: usize,
}

/// Appends `FAILOVER_EVENTS` events in batches, retrying a batch that fails `Unavailable` with
/// the same msg ids until it is acknowledged, as a connector does; publishes the number of
/// acknowledged events on `progress`. Appends only as far as `gate` allows.
async fn write_through_failovers(
    log: Arc<JetStreamLog>,
    progress: tokio::sync::watch::Sender<usize>,
    mut gate: tokio::sync::watch::Receiver<usize>,
) -> Written {
    let mut written = Written { acknowledged: Vec::new(), batch_done_at: Vec::new(), failed_attempts: 0 };
    for first in (0..FAILOVER_EVENTS).step_by(FAILOVER_BATCH) {
        let batch: Vec<AppendRecord> = (first..(first + FAILOVER_BATCH).min(FAILOVER_EVENTS))
            .map(|index| AppendRecord {
                subject: subjects().agent(&format!("a{}", index % 7)),
                msg_id: format!("failover-{index}"),
                payload: Bytes::from(index.to_string()),
            })
            .collect();
        let end = first + batch.len();
        gate.wait_for(|allowed| *allowed >= end).await.expect("the test holds the gate");
        let deadline = tokio::time::Instant::now() + CLUSTER_STEP_DEADLINE;
        let outcomes = loop {
            match log.append_batch(batch.clone()).await {
                Ok(outcomes) => break outcomes,
                Err(LogError::Unavailable(reason)) if tokio::time::Instant::now() < deadline => {
                    written.failed_attempts += 1;
                    tracing::debug!(%reason, first, "batch unavailable; retrying with the same msg ids");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
                Err(e) => panic!("batch from event {first} failed for good: {e}"),
            }
        };
        written.acknowledged.extend(outcomes.iter().map(|outcome| outcome.seq()));
        written.batch_done_at.push(tokio::time::Instant::now());
        progress.send_replace(written.acknowledged.len());
    }
    written
}

/// The log on an R3 stream of the cluster (placed already: [`NatsCluster::start_placing`]). A
/// connect that stays unavailable for [`CLUSTER_STEP_DEADLINE`] fails the test with the last
/// reason it gave.
async fn connect_r3(cluster: &NatsCluster) -> JetStreamLog {
    let config = JetStreamConfig { url: cluster.urls(), replicas: 3, ..JetStreamConfig::default() };
    let connect = || {
        let config = config.clone();
        async move {
            match JetStreamLog::connect(config).await {
                Ok(log) => Ok(log),
                Err(LogError::Unavailable(reason)) => Err(reason),
                Err(e) => panic!("connect to the cluster: {e}"),
            }
        }
    };
    match poll_reporting(CLUSTER_STEP_DEADLINE, Duration::from_millis(20), connect).await {
        Ok(log) => log,
        Err(reason) => panic!("the R3 stream is created: not within {CLUSTER_STEP_DEADLINE:?}; last: {reason}"),
    }
}

/// Given a 3-node cluster and an R3 stream, when the stream leader is killed (SIGKILL) three
/// times while one writer appends 70,000 events (each failed batch retried with the same msg
/// ids), and then the node the log is connected to freezes, then every event is stored exactly once, at the seq its ack reported: nothing
/// acknowledged is lost, nothing is duplicated. Prints how long appends were unavailable after
/// each kill (not asserted: speed is the report's, not the test's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_stream_leader_loses_and_duplicates_no_acknowledged_event() {
    let test_started = tokio::time::Instant::now();
    let mut cluster = NatsCluster::start_placing().await;
    let log = connect_r3(&cluster).await;
    let log = Arc::new(log);
    let admin = cluster.admin().await;
    poll_until("the stream has a leader and current followers", || async {
        stream_view(&admin, "ANIMA").await.filter(|view| view.followers_current)
    })
    .await;

    let (progress_tx, mut progress) = tokio::sync::watch::channel(0usize);
    let (gate, gate_rx) = tokio::sync::watch::channel(0usize);
    let open_gate = |to: usize| gate.send_modify(|allowed| *allowed = (*allowed).max(to).min(FAILOVER_EVENTS));
    let writer = tokio::spawn(write_through_failovers(log.clone(), progress_tx, gate_rx));
    let mut kills = Vec::new();
    for threshold in KILL_AFTER_ACKNOWLEDGED {
        open_gate(threshold + WRITER_SLACK_EVENTS);
        tokio::time::timeout(CLUSTER_STEP_DEADLINE, progress.wait_for(|acknowledged| *acknowledged >= threshold))
            .await
            .unwrap_or_else(|_| panic!("the writer did not reach {threshold} events"))
            .expect("the writer is running");
        let leader = poll_until("the stream leader is known", || stream_view(&admin, "ANIMA")).await.leader;
        let node = cluster.node_named(&leader).unwrap_or_else(|| panic!("leader {leader:?} is not a node"));
        let acknowledged_at_kill = *progress.borrow();
        open_gate(acknowledged_at_kill + WRITER_SLACK_EVENTS);
        tokio::task::block_in_place(|| cluster.node(node).kill());
        let killed_at = tokio::time::Instant::now();
        let new_leader = poll_until("a new stream leader is elected", || async {
            stream_view(&admin, "ANIMA").await.filter(|view| view.leader != leader)
        })
        .await
        .leader;
        let elected_at = tokio::time::Instant::now();
        // Appends go on with two nodes; then the killed one comes back and catches up.
        tokio::time::timeout(
            CLUSTER_STEP_DEADLINE,
            progress.wait_for(|acknowledged| *acknowledged >= acknowledged_at_kill + FAILOVER_BATCH),
        )
        .await
        .unwrap_or_else(|_| panic!("no appends after killing {leader}"))
        .expect("the writer is running");
        tokio::task::block_in_place(|| cluster.node(node).resume());
        poll_until("the restarted node catches up", || async {
            stream_view(&admin, "ANIMA").await.filter(|view| view.followers_current)
        })
        .await;
        kills.push((leader, new_leader, acknowledged_at_kill, killed_at, elected_at));
    }
    // A leader asked to step down (the engine's remedy for a publish it keeps answering "in
    // process") hands the stream to another replica, and appends go on.
    let leader_before = poll_until("the stream leader is known", || stream_view(&admin, "ANIMA")).await.leader;
    let acknowledged_at_step_down = *progress.borrow();
    open_gate(acknowledged_at_step_down + WRITER_SLACK_EVENTS);
    log.step_down_leader().await.expect("the stream leader is asked to step down");
    let leader_after = poll_until("another leader after the step-down", || async {
        stream_view(&admin, "ANIMA").await.filter(|view| view.leader != leader_before && view.followers_current)
    })
    .await
    .leader;
    tokio::time::timeout(
        CLUSTER_STEP_DEADLINE,
        progress.wait_for(|acknowledged| *acknowledged >= acknowledged_at_step_down + FAILOVER_BATCH),
    )
    .await
    .unwrap_or_else(|_| panic!("no appends after {leader_before} stepped down for {leader_after}"))
    .expect("the writer is running");
    eprintln!(
        "  step-down of leader {leader_before} after {acknowledged_at_step_down} events: new leader {leader_after}"
    );

    // Then the node the log is connected to freezes (SIGSTOP): the client must notice by its
    // pings and move to another node.
    let frozen = log.connected_server();
    let frozen_node = cluster.node_named(&frozen).unwrap_or_else(|| panic!("connected to {frozen:?}, not a node"));
    let acknowledged_at_freeze = *progress.borrow();
    // The writer may have run ahead by its slack; the freeze step needs two more batches.
    assert!(
        acknowledged_at_freeze + 2 * FAILOVER_BATCH <= FAILOVER_EVENTS,
        "the writer ran to {acknowledged_at_freeze} of {FAILOVER_EVENTS}: no room left for the freeze step"
    );
    open_gate(acknowledged_at_freeze + WRITER_SLACK_EVENTS);
    cluster.node(frozen_node).freeze();
    let frozen_at = tokio::time::Instant::now();
    // The batch in flight may have had all its acks before the freeze; the one after it is sent
    // after the freeze, so it can only be acknowledged through another node.
    tokio::time::timeout(
        CLUSTER_STEP_DEADLINE,
        progress.wait_for(|acknowledged| *acknowledged >= acknowledged_at_freeze + 2 * FAILOVER_BATCH),
    )
    .await
    .unwrap_or_else(|_| panic!("no appends while {frozen} is frozen"))
    .expect("the writer is running");
    let moved_to = log.connected_server();
    cluster.node(frozen_node).thaw();
    open_gate(FAILOVER_EVENTS);
    let written =
        tokio::time::timeout(4 * CLUSTER_STEP_DEADLINE, writer).await.expect("the writer finishes").expect("writer");

    // Every event exactly once, where its ack said.
    let last_seq = log.last_seq().await.expect("last seq");
    let stream = log.read(1, last_seq, None).await.expect("read");
    let stored: Vec<StoredRecord> =
        tokio::time::timeout(CLUSTER_STEP_DEADLINE, stream.map(|r| r.expect("record")).collect())
            .await
            .expect("the read ends");
    let mut stored_seq_of: Vec<Option<u64>> = vec![None; FAILOVER_EVENTS];
    let mut duplicates = 0;
    for record in &stored {
        let index: usize = std::str::from_utf8(&record.payload).expect("utf-8").parse().expect("an event index");
        if stored_seq_of[index].replace(record.seq).is_some() {
            duplicates += 1;
        }
    }
    let lost = (0..FAILOVER_EVENTS).filter(|index| stored_seq_of[*index] != Some(written.acknowledged[*index])).count();
    eprintln!(
        "cluster failover: {} events acknowledged, {} stored, {} kills of the stream leader, {lost} lost, \
         {duplicates} duplicated, {} failed batch attempts retried, {:.1} s in all",
        written.acknowledged.len(),
        stored.len(),
        kills.len(),
        written.failed_attempts,
        test_started.elapsed().as_secs_f64()
    );
    // Appends count as unavailable from a kill (or the freeze) until the first batch sent wholly
    // after it is acknowledged: the one after the batch in flight then.
    let first_batch_after = |acknowledged: usize| written.batch_done_at[acknowledged / FAILOVER_BATCH + 1];
    for (leader, new_leader, acknowledged_at_kill, killed_at, elected_at) in &kills {
        let resumed_at = first_batch_after(*acknowledged_at_kill);
        eprintln!(
            "  kill of leader {leader} after {acknowledged_at_kill} events: new leader {new_leader} after {:.2} s, \
             appends unavailable {:.2} s ({:.2} s after the election)",
            (*elected_at - *killed_at).as_secs_f64(),
            (resumed_at - *killed_at).as_secs_f64(),
            resumed_at.saturating_duration_since(*elected_at).as_secs_f64(),
        );
    }
    let resumed_at = first_batch_after(acknowledged_at_freeze);
    eprintln!(
        "  freeze of {frozen} (the node the log was connected to) after {acknowledged_at_freeze} events: \
         appends unavailable {:.2} s, connection moved to {moved_to}",
        (resumed_at - frozen_at).as_secs_f64()
    );
    assert_ne!(moved_to, frozen, "the log left the frozen node");
    assert_eq!(written.acknowledged.len(), FAILOVER_EVENTS, "every batch was acknowledged in the end");
    assert_eq!(kills.len(), KILL_AFTER_ACKNOWLEDGED.len());
    assert_eq!(duplicates, 0, "no event is stored twice");
    assert_eq!(lost, 0, "every acknowledged event is stored, at the seq its ack reported");
    assert_eq!(stored.len(), FAILOVER_EVENTS, "nothing else is stored");
}

/// Follows that get a new consumer before one lands on a node fit to kill.
const CONSUMER_PLACEMENT_TRIES_MAX: usize = 20;

/// The node the stream's only consumer runs on (an ordered consumer is one replica, placed on
/// any node of the stream) and its name.
async fn only_consumer(admin: &async_nats::jetstream::Context) -> (String, String) {
    let stream = admin.get_stream("ANIMA").await.expect("stream");
    let consumers: Vec<_> = stream.consumers().collect().await;
    assert_eq!(consumers.len(), 1, "one follow, one consumer: {consumers:?}");
    let info = consumers.into_iter().next().expect("one").expect("consumer info");
    let node = info.cluster.and_then(|cluster| cluster.leader).expect("a clustered consumer has a node");
    (node, info.name)
}

/// Given a follow whose consumer runs on a follower node of the R3 stream, when that node is
/// killed (SIGKILL), no leader changes and the follow's connection stays up, so nothing announces
/// that the consumer is gone; events appended after the kill still reach the follow, in order.
/// Prints how long after the first of them was acknowledged the follow delivered it (not
/// asserted: speed is the report's, not the test's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_whose_consumer_dies_with_its_node_delivers_what_is_appended_after() {
    let mut cluster = NatsCluster::start_placing().await;
    let log = connect_r3(&cluster).await;
    let admin = cluster.admin().await;
    poll_until("the stream has a leader and current followers", || async {
        stream_view(&admin, "ANIMA").await.filter(|view| view.followers_current)
    })
    .await;
    log.append(record("before-the-kill")).await.expect("append");

    // Placement is the server's choice: follow again until the consumer is on neither the
    // stream leader (its death would be announced by an election) nor the node the log is
    // connected to (its death would be a disconnect).
    let mut placement = None;
    for _ in 0..CONSUMER_PLACEMENT_TRIES_MAX {
        let mut follow = log.follow(1, None).await.expect("follow");
        let first = tokio::time::timeout(CLUSTER_STEP_DEADLINE, follow.next()).await.expect("a first record");
        assert_eq!(first.expect("live").expect("record").seq, 1);
        let (node, consumer) = only_consumer(&admin).await;
        let leader = poll_until("the stream leader is known", || stream_view(&admin, "ANIMA")).await.leader;
        if node != leader && node != log.connected_server() {
            placement = Some((follow, node));
            break;
        }
        drop(follow);
        let stream = admin.get_stream("ANIMA").await.expect("stream");
        stream.delete_consumer(&consumer).await.expect("the dropped follow's consumer is deleted");
    }
    let (mut follow, node) = placement.expect("a consumer on a follower node within the tries");
    let index = cluster.node_named(&node).unwrap_or_else(|| panic!("consumer on {node:?}, not a node"));
    tokio::task::block_in_place(|| cluster.node(index).kill());

    let appended = poll_until("an append after the kill", || async {
        match log.append(record("after-the-kill")).await {
            Ok(outcome) => Some(outcome.seq()),
            Err(LogError::Unavailable(_)) => None,
            Err(e) => panic!("append after the kill: {e}"),
        }
    })
    .await;
    let acknowledged_at = tokio::time::Instant::now();
    let delivered = tokio::time::timeout(CLUSTER_STEP_DEADLINE, follow.next())
        .await
        .expect("the follow delivers the event appended after the kill")
        .expect("live")
        .expect("record");
    eprintln!(
        "  consumer node {node} killed: the follow delivered seq {} {:.2} s after its append was acknowledged",
        delivered.seq,
        acknowledged_at.elapsed().as_secs_f64()
    );
    assert_eq!(delivered.seq, appended, "the next record is the one appended after the kill");
    assert_eq!(delivered.seq, 2);
    // However the follow got it, it is the record any reader gets: same time, subject, payload
    // (the fold decides with the log's time). A read needs a consumer, so it may have to wait
    // for the cluster to place one again; it is read before the killed node returns, because a
    // read's consumer placed on a replica still catching up ends at what that replica has.
    let read = poll_until("a read of the event", || async {
        let records = log.read(2, 2, None).await.ok()?;
        let records: Vec<StoredRecord> =
            records.collect::<Vec<_>>().await.into_iter().collect::<Result<_, _>>().ok()?;
        (!records.is_empty()).then_some(records)
    })
    .await;
    assert_eq!(read, vec![delivered]);
    tokio::task::block_in_place(|| cluster.node(index).resume());
}
