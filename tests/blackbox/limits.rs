//! Input bounds at ingest through the binary: a Slack message of 1,000,000 bytes of text is
//! refused with `RESOURCE_EXHAUSTED` and appends nothing, while one of 160,000 bytes (Slack's
//! 40,000 characters, four bytes each) is journaled. The bound counts characters as well as
//! bytes, so 40,001 one-byte characters are refused too.
//!
//! "Appends nothing" is checked through the log's sequences: both backends number events densely,
//! so the next accepted message lands right after the one before the refusals.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

/// Text over every bound: 1,000,000 bytes.
const TEXT_BYTES_OVER: usize = 1_000_000;
/// Slack's bound: 40,000 characters and 160,000 bytes; a four-byte character fills both at once.
const TEXT_CHARS_MAX: usize = 40_000;
const FOUR_BYTE_CHAR: char = '😀';

/// A message in channel C1 from a human, received by ada's app.
fn message(ts: &str, text: String) -> api::AppendRequest {
    slack_message(&["ada"], "C1", ts, "", "U1", &text)
}

async fn scenario(backend: Backend) {
    let server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;

    let before = ingest.append(message("1700000000.000100", "a short one".into())).await.expect("append");
    let before_seq = before.into_inner().outcomes[0].seq;

    let huge = "x".repeat(TEXT_BYTES_OVER);
    let refused = ingest.append(message("1700000000.000200", huge)).await.expect_err("1 MB of text is refused");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().starts_with("text:"), "the refusal names the field: {refused:?}");

    // 160,000 ASCII bytes are 160,000 characters: over Slack's 40,000-character bound.
    let too_many_chars = "x".repeat(TEXT_CHARS_MAX + 1);
    let refused = ingest.append(message("1700000000.000300", too_many_chars)).await.expect_err("40,001 characters");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");

    let largest: String = std::iter::repeat_n(FOUR_BYTE_CHAR, TEXT_CHARS_MAX).collect();
    assert_eq!(largest.len(), 160_000);
    let accepted = ingest.append(message("1700000000.000400", largest)).await.expect("160,000 bytes are accepted");
    let outcome = &accepted.into_inner().outcomes[0];
    assert_eq!(outcome.seq, before_seq + 1, "the refused messages appended nothing");
    assert_eq!((outcome.surface.as_str(), outcome.ordinal), ("slack:T1:C1", 2), "journaled after the short one");
    assert!(!outcome.duplicate_event);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_bounds_on_the_embedded_log() {
    scenario(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_bounds_on_jetstream() {
    scenario(Backend::JetStream).await;
}

/// A log filter that does not parse stops start-up naming the variable (it is not silently
/// `info`), and the error reads as one line even with `RUST_BACKTRACE=1`.
#[test]
fn a_bad_log_filter_is_refused_in_one_readable_line() {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = std::process::Command::new(binary())
        .arg("serve")
        .arg("--data")
        .arg(dir.path())
        .arg("--listen")
        .arg("127.0.0.1:0")
        .env_remove("ANIMA_LOG")
        .env("RUST_LOG", "info,[[[")
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run anima-wake");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("RUST_LOG: not a log filter"), "{stderr}");
    assert!(!stderr.contains("backtrace"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}
