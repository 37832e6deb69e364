//! Bad input answered well through the binary: a request over the transport limit is
//! `RESOURCE_EXHAUSTED` naming the limit (tonic itself would say `OUT_OF_RANGE`); a refusal
//! quotes a huge value only clipped, so the client gets the refusal and not "metadata size
//! exceeds hard limit"; `Confirm` checks its `request_id` like every RPC; and configurations
//! that would be silently wrong stop start-up naming the key.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

/// Over tonic's default 4 MiB decoding limit.
const OVER_TRANSPORT_BYTES: usize = 5 * 1024 * 1024;
/// Far over every field bound.
const HUGE_BYTES: usize = 1_000_000;
/// Longest refusal expected: field, reason and a value clipped to 64 bytes.
const REFUSAL_BYTES_MAX: usize = 512;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_size_requests_and_huge_values_get_the_refusal_they_deserve() {
    let server = Server::start(Backend::Embedded);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let over = slack_message(&["ada"], "C1", "1700000000.000100", "", "U1", &"x".repeat(OVER_TRANSPORT_BYTES));
    let refused = ingest.append(over).await.expect_err("5 MiB is over the transport limit");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("transport limit is 4194304 bytes"), "{refused:?}");

    let huge = "9".repeat(HUGE_BYTES);
    let refused =
        ingest.append(slack_message(&["ada"], "C1", &huge, "", "U1", "hello")).await.expect_err("a 1 MB ts is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("ts:"), "names the field: {:.200}", refused.message());
    assert!(refused.message().len() <= REFUSAL_BYTES_MAX, "{} bytes", refused.message().len());

    let mut memory = server.memory(ADMIN_TOKEN).await;
    let refused =
        memory.status(api::MemoryStatusRequest { agent_id: huge.clone() }).await.expect_err("no agent has a 1 MB id");
    assert!(refused.message().starts_with("agent_id:"), "names the field: {:.200}", refused.message());
    assert!(refused.message().len() <= REFUSAL_BYTES_MAX, "{} bytes", refused.message().len());

    let mut sends = server.sends(CONNECTOR_TOKEN).await;
    let confirm = api::SendsConfirmRequest {
        agent_id: "ada".into(),
        target: Some(slack_target("C1", "")),
        kind: api::SendKind::Message as i32,
        ts: "1700000000.000200".into(),
        text: "posted".into(),
        request_id: "not-a-uuid".into(),
        ..Default::default()
    };
    let refused = sends.confirm(confirm).await.expect_err("a malformed request id is refused");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("request_id:"), "{refused:?}");
}

/// Bytes that are not the RPC's message (here `Memory.Status`'s request, whose field 1 is a
/// string, sent to `Replay.Explain`, whose field 1 is a number) are the client's mistake:
/// INVALID_ARGUMENT, not tonic-prost's INTERNAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_the_rpcs_message_is_invalid_argument() {
    let server = Server::start(Backend::Embedded);
    let mut grpc = tonic::client::Grpc::new(server.channel().await);
    grpc.ready().await.expect("ready");
    let mut request = tonic::Request::new(api::MemoryStatusRequest { agent_id: "ada".into() });
    request.metadata_mut().insert("authorization", format!("Bearer {ADMIN_TOKEN}").parse().expect("ascii"));
    let codec = tonic_prost::ProstCodec::<api::MemoryStatusRequest, api::ReplayExplainResponse>::default();
    let path = "/anima.v1.Replay/Explain".parse().expect("a path");
    let refused = grpc.unary(request, path, codec).await.expect_err("not an ExplainRequest");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("request: not a valid message of this RPC"), "{refused:?}");
}

#[test]
fn configurations_that_would_be_silently_wrong_stop_start_up_naming_the_key() {
    let listen = ["--listen", "127.0.0.1:0"];
    let twice = format!("{CONFIG}\n[[agents]]\nid = \"ada\"\n");
    let stderr = serve_refused(&twice, &listen);
    assert!(stderr.contains("agents[2].id: \"ada\" is already agents[0].id"), "{stderr}");

    let shared = "[[tokens]]\ntoken = \"shared-secret-0123456789\"\nrole = \"analytics\"\n\
                  [[tokens]]\ntoken = \"shared-secret-0123456789\"\nrole = \"admin\"\n";
    let stderr = serve_refused(shared, &listen);
    assert!(stderr.contains("tokens[1]: the same token as tokens[0]"), "{stderr}");
    assert!(!stderr.contains("shared-secret"), "the secret is never printed: {stderr}");

    let stderr = serve_refused("", &["--listen", "127.0.0.1:0", "--metrics-listen", "0.0.0.0:0"]);
    assert!(stderr.contains("metrics_listen (--metrics-listen, ANIMA_METRICS_LISTEN): 0.0.0.0:0"), "{stderr}");

    let stderr =
        serve_refused("", &["--listen", "127.0.0.1:0", "--nats", "nats://127.0.0.1:4222,nats://127.0.0.1:99999"]);
    assert!(
        stderr.contains("nats (--nats, ANIMA_NATS): \"nats://127.0.0.1:99999\" is not a NATS server URL"),
        "{stderr}"
    );
    assert!(!stderr.contains("unavailable"), "a typo is not an outage: {stderr}");

    let (ok, _, stderr) = Server::run_tool(&[
        "replay",
        "--nats",
        "nats://127.0.0.1:4222,nats://127.0.0.1:99999",
        "timeline",
        "--agent",
        "ada",
    ]);
    assert!(!ok, "replay with a bad server list fails");
    assert!(stderr.contains("--nats (ANIMA_NATS): \"nats://127.0.0.1:99999\" is not a NATS server URL"), "{stderr}");
}
