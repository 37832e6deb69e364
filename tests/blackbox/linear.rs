//! Linear end to end through the binary: a `created` session event wakes the agent with the
//! session as reply target, a connector retry dedupes, the wake starts with its empty plan and
//! finishes; a response gets one activity id for one key, and while its outcome is unknown a
//! different response to the same inputs is refused. The auth matrix scopes both RPCs.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

const SESSION: &str = "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01";

fn linear_created(session: &str, prompt: &str) -> api::AppendRequest {
    api::AppendRequest {
        correlation_id: session.to_owned(),
        observation: Some(api::append_request::Observation::LinearSession(api::LinearSession {
            receiving_agent_id: "ada".into(),
            installation_id: "inst1".into(),
            kind: api::LinearSessionEventKind::Created as i32,
            session_id: session.into(),
            issue_identifier: "ENG-42".into(),
            issue_url: "https://linear.app/acme/issue/ENG-42".into(),
            issue_title: "Flaky login test".into(),
            prompt_text: prompt.into(),
            ..Default::default()
        })),
    }
}

fn respond(body: &str, input: &str) -> api::RespondRequest {
    api::RespondRequest {
        agent_id: "ada".into(),
        session_id: SESSION.into(),
        kind: api::LinearResponseKind::Response as i32,
        body: body.into(),
        input_ids: vec![input.to_owned()],
        request_id: String::new(),
    }
}

async fn scenario(backend: Backend) {
    let server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;

    let created = linear_created(SESSION, "please look at the flaky login test");
    let appended = ingest.append(created.clone()).await.expect("append").into_inner();
    let outcome = &appended.outcomes[0];
    let receipt = format!("linear:inst1:created:{SESSION}");
    assert_eq!(
        (outcome.wake_reason.as_str(), outcome.receipt_id.as_str()),
        ("linear", receipt.as_str()),
        "{outcome:?}"
    );
    let retry = ingest.append(created).await.expect("retry").into_inner();
    assert!(retry.outcomes[0].duplicate_event, "a connector retry dedupes in the log");
    let error = ingest.append(linear_created("not-a-uuid", "x")).await.expect_err("session id");
    assert_eq!(error.code(), Code::InvalidArgument);
    let error = ingest.append(linear_created(SESSION, &"a".repeat(160_001))).await.expect_err("prompt too large");
    assert_eq!(error.code(), Code::ResourceExhausted);

    let wake = wakes
        .claim(api::ClaimRequest { agent_id: "ada".into(), worker_id: "w1".into(), ..Default::default() })
        .await
        .expect("claim")
        .into_inner()
        .wake
        .expect("a wake to claim");
    assert_eq!((wake.item_id.as_str(), wake.reason.as_str()), (receipt.as_str(), "linear"));
    assert!(wake.text.contains(&format!("reply_to: linear session={SESSION}\n")), "{}", wake.text);
    assert!(wake.text.contains("> please look at the flaky login test\n"), "{}", wake.text);
    let session_target = api::ReplyTarget {
        target: Some(api::reply_target::Target::Linear(api::LinearTarget { session_id: SESSION.into() })),
    };
    assert_eq!(wake.reply_to.as_ref(), Some(&session_target));
    assert!(wake.plan.is_empty(), "a Linear wake's plan moves nothing");
    wakes
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: "w1".into(),
            item_id: wake.item_id.clone(),
            plan: Vec::new(),
            request_id: String::new(),
        })
        .await
        .expect("start with the empty plan");

    // Sends.Send does not answer a session; Respond does, with one activity id per key.
    let error = sends.send(send_request("ada", session_target)).await.expect_err("send to a session");
    assert_eq!(error.code(), Code::InvalidArgument);
    let first = sends.respond(respond("fixed in #12", &receipt)).await.expect("respond").into_inner();
    assert_eq!((first.state.as_str(), first.repeated), ("requested", false));
    let again = sends.respond(respond("fixed in #12", &receipt)).await.expect("respond").into_inner();
    assert_eq!((again.activity_id.as_str(), again.repeated), (first.activity_id.as_str(), true));
    let unknown = sends
        .confirm_response(api::ConfirmResponseRequest {
            agent_id: "ada".into(),
            activity_id: first.activity_id.clone(),
            result: api::LinearResponseResult::Unknown as i32,
            request_id: String::new(),
        })
        .await
        .expect("confirm response")
        .into_inner();
    assert_eq!(unknown.state, "unknown");
    let error = sends.respond(respond("fixed in #13", &receipt)).await.expect_err("a different body");
    assert_eq!(error.code(), Code::FailedPrecondition);

    // A runtime token touches only its own agents.
    let mut bob = server.sends(BOB_RUNTIME_TOKEN).await;
    let error = bob.respond(respond("fixed in #12", &receipt)).await.expect_err("bob for ada");
    assert_eq!(error.code(), Code::PermissionDenied);

    wakes
        .finish(api::FinishRequest {
            agent_id: "ada".into(),
            worker_id: "w1".into(),
            item_id: wake.item_id,
            outcome: api::WakeOutcome::Completed as i32,
            ..Default::default()
        })
        .await
        .expect("finish");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linear_on_the_embedded_log() {
    scenario(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linear_on_jetstream() {
    scenario(Backend::JetStream).await;
}
