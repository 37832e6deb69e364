//! JetStream in production shape: a server list instead of one URL, and (with the 3-node
//! fixture of `anima_engine::testing`) failover of the stream leader under load.

use std::time::Duration;

use anima_engine::log::jetstream::{JetStreamConfig, JetStreamLog};
use anima_engine::log::{AppendRecord, EventLog, LogError};
use anima_engine::subject::agent_subject;
use anima_engine::testing::NatsServer;
use bytes::Bytes;

fn record(msg_id: &str) -> AppendRecord {
    AppendRecord { subject: agent_subject("a1"), msg_id: msg_id.to_owned(), payload: Bytes::from_static(b"x") }
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
