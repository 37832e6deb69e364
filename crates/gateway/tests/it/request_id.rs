//! A client's `request_id` is an idempotency key: a retry of the same request gets the same
//! verdict, and the same id sent with another kind of request is refused naming the field (it
//! used to reach the client as FAILED_PRECONDITION "the fold recorded an unexpected verdict",
//! which reads like a server bug; the API fuzz test found it).

use anima_gateway::api;
use tonic::Code;

use crate::fixture::{admin, Fixture};

const REQUEST_ID: &str = "019b0000-0000-7000-8000-000000000001";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_sent_with_another_kind_of_request_is_refused_naming_it() {
    let fixture = Fixture::start().await;
    let mut wakes = api::wakes_client::WakesClient::with_interceptor(fixture.channel.clone(), admin);
    let mut subscriptions =
        api::subscriptions_client::SubscriptionsClient::with_interceptor(fixture.channel.clone(), admin);
    let claim = api::ClaimRequest {
        agent_id: "ada".into(),
        worker_id: "w1".into(),
        request_id: REQUEST_ID.into(),
        ..Default::default()
    };
    // Given a claim made with the id (ada has nothing queued: no wake, but a verdict),
    let first = wakes.claim(claim.clone()).await.expect("the claim").into_inner();
    assert!(first.wake.is_none(), "{first:?}");

    // when a mute comes with the same id, it is refused, naming the field;
    let mute = api::MuteRequest {
        agent_id: "ada".into(),
        target: Some(api::SlackTarget { team_id: "T1".into(), channel_id: "C1".into(), thread_ts: String::new() }),
        request_id: REQUEST_ID.into(),
        ..Default::default()
    };
    let refused = subscriptions.mute(mute).await.expect_err("the id names a claim");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with(&format!("request_id: \"{REQUEST_ID}\" was already used for another kind")),
        "{refused:?}"
    );

    // and a retry of the claim still gets the claim's verdict.
    let again = wakes.claim(claim).await.expect("the retried claim").into_inner();
    assert_eq!(again, first);
    fixture.server.shutdown().await.expect("a clean shutdown");
}

/// Given a send by ada under a request id, when the same id comes with bob's send, then it is
/// refused naming the field — bob never gets ada's verdict (a held notice would show ada's
/// conversation) — and ada's retry still gets hers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_of_another_agents_request_is_refused_and_shows_nothing_of_it() {
    const ID: &str = "019b0000-0000-7000-8000-000000000002";
    let fixture = Fixture::start().await;
    let mut sends = api::sends_client::SendsClient::with_interceptor(fixture.channel.clone(), admin);
    let send = |agent: &str| api::SendRequest {
        agent_id: agent.into(),
        target: Some(api::ReplyTarget {
            target: Some(api::reply_target::Target::Slack(api::SlackTarget {
                team_id: "T1".into(),
                channel_id: "D1".into(),
                thread_ts: String::new(),
            })),
        }),
        kind: api::SendKind::Message as i32,
        request_id: ID.into(),
        ..Default::default()
    };
    let first = sends.send(send("ada")).await.expect("ada's send").into_inner();
    let refused = sends.send(send("bob")).await.expect_err("the id names ada's send");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with(&format!("request_id: \"{ID}\" was already used for another agent's request")),
        "{refused:?}"
    );
    let again = sends.send(send("ada")).await.expect("ada's retry").into_inner();
    assert_eq!(again, first);
    fixture.server.shutdown().await.expect("a clean shutdown");
}
