//! Guards of the reply path, end to end through the binary on both backends: a send repeated
//! after its post was confirmed answers "already posted" (a runtime retrying after a lost
//! response never posts twice), a Slack thread stop removes that thread's queued input, and a
//! failed wake a person asked for leaves a failure notice owed until the agent posts there, and
//! a send that would reach a person on the do-not-contact list is refused before the hold.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

const SEND_ID: &str = "01937a5e-0000-7000-8000-00000000a001";

fn send_with_id(request_id: &str) -> api::SendRequest {
    api::SendRequest { request_id: request_id.into(), ..send_request("ada", slack_target("D1", "")) }
}

fn confirm(ts: &str, send_request_id: &str) -> api::SendsConfirmRequest {
    api::SendsConfirmRequest {
        agent_id: "ada".into(),
        target: Some(slack_target("D1", "")),
        kind: api::SendKind::Message as i32,
        ts: ts.into(),
        text: "my answer".into(),
        send_request_id: send_request_id.into(),
        ..Default::default()
    }
}

fn thread_stop(thread_ts: &str, occurred_at_ms: i64) -> api::AppendRequest {
    api::AppendRequest {
        correlation_id: format!("stop-{thread_ts}"),
        observation: Some(api::append_request::Observation::SlackThreadStop(api::SlackThreadStop {
            receiving_agent_id: "ada".into(),
            team_id: "T1".into(),
            channel_id: "D1".into(),
            thread_ts: thread_ts.into(),
            occurred_at_ms,
        })),
    }
}

async fn posted_do_not_resend(backend: Backend) {
    let mut server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    ingest.append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "hello ada")).await.expect("append");

    // Given a send allowed and its post confirmed naming the send,
    let first = sends.send(send_with_id(SEND_ID)).await.expect("send").into_inner();
    assert!(matches!(first.verdict, Some(api::send_response::Verdict::Allowed(_))), "{first:?}");
    let confirmed = sends.confirm(confirm("1700000002.000100", SEND_ID)).await.expect("confirm").into_inner();

    // when the runtime repeats the send (its response was lost), then it is told the post exists.
    let repeat = sends.send(send_with_id(SEND_ID)).await.expect("send").into_inner();
    let Some(api::send_response::Verdict::AlreadyPosted(posted)) = repeat.verdict else {
        panic!("a repeated send after its post is not allowed again: {repeat:?}")
    };
    assert_eq!((posted.ts.as_str(), posted.confirmed_at_seq), ("1700000002.000100", confirmed.seq));
    assert_eq!(repeat.decided_at_seq, first.decided_at_seq, "the verdict is still the recorded one");

    // A new send (another request id) is decided as usual: the agent's own post is not news.
    let next = sends.send(send_with_id("")).await.expect("send").into_inner();
    assert!(matches!(next.verdict, Some(api::send_response::Verdict::Allowed(_))), "{next:?}");

    // A malformed send id is refused naming the field.
    let refused = sends.confirm(confirm("1700000003.000100", "not-a-uuid")).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("send_request_id"), "{}", refused.message());

    // The post is remembered across a restart.
    server.restart();
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let repeat = sends.send(send_with_id(SEND_ID)).await.expect("send").into_inner();
    assert!(matches!(repeat.verdict, Some(api::send_response::Verdict::AlreadyPosted(_))), "{repeat:?}");
}

async fn slack_thread_stop(backend: Backend) {
    let server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let thread = "1700000001.000100";
    // Given two messages in a DM thread and one on the DM's top level, all queued,
    for (ts, thread_ts, text) in [
        (thread, "", "start of a thread"),
        ("1700000002.000100", thread, "in the thread"),
        ("1700000003.000100", "", "on the top level"),
    ] {
        let appended = ingest.append(slack_message(&["ada"], "D1", ts, thread_ts, "U1", text)).await.expect("append");
        assert_eq!(appended.into_inner().outcomes[0].wake_reason, "dm");
    }

    // when the user stops ada in the thread, then the thread's reply is removed (its parent lives
    // on the top level and answers there),
    let stopped = ingest.append(thread_stop(thread, 1_700_000_004_000)).await.expect("stop").into_inner();
    assert_eq!(stopped.outcomes.len(), 1);
    let outcome = &stopped.outcomes[0];
    assert_eq!(outcome.surface, format!("slack:T1:D1:thread:{thread}"));
    assert_eq!(outcome.removed_item_ids, ["slack:T1:D1:1700000002.000100"]);
    assert!(!outcome.duplicate_event);

    // a connector's retry of the stop is deduped,
    let retried = ingest.append(thread_stop(thread, 1_700_000_004_000)).await.expect("stop").into_inner();
    assert!(retried.outcomes[0].duplicate_event);

    // and the wakes left are the top-level ones.
    let claimed = claim_and_start(&mut wakes, "ada", "w1", 0).await;
    assert_ne!(claimed.item_id, "slack:T1:D1:1700000002.000100");
    assert!(!claimed.text.contains("> in the thread"), "{}", claimed.text);

    // A stop must say when it happened (that is what tells two stops apart).
    let refused = ingest.append(thread_stop(thread, 0)).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("occurred_at_ms"), "{}", refused.message());
}

async fn failure_notice_owed(backend: Backend) {
    let server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let mut watch = wakes.watch(api::WatchRequest { agent_id: "ada".into() }).await.expect("watch").into_inner();
    assert_eq!(next_signal(&mut watch).await.notices_owed, 0);

    // Given a DM wake that ran and finished failed,
    ingest.append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "please do it")).await.expect("append");
    let wake = claim_and_start(&mut wakes, "ada", "w1", 0).await;
    wakes
        .finish(api::FinishRequest {
            agent_id: "ada".into(),
            worker_id: "w1".into(),
            item_id: wake.item_id.clone(),
            outcome: api::WakeOutcome::Failed as i32,
            reason: "the tool crashed".into(),
            ..Default::default()
        })
        .await
        .expect("finish");

    // then Watch signals a notice owed, and Claim lists it with where it goes.
    let mut signal = next_signal(&mut watch).await;
    while signal.notices_owed == 0 {
        signal = next_signal(&mut watch).await;
    }
    assert_eq!(signal.notices_owed, 1);
    let claim =
        |worker: &str| api::ClaimRequest { agent_id: "ada".into(), worker_id: worker.into(), ..Default::default() };
    let claimed = wakes.claim(claim("w1")).await.expect("claim").into_inner();
    assert!(claimed.wake.is_none(), "nothing else to do");
    assert_eq!(claimed.notices_owed.len(), 1, "{claimed:?}");
    let notice = &claimed.notices_owed[0];
    assert_eq!(
        (notice.item_id.as_str(), notice.reason.as_str(), notice.wake_reason.as_str()),
        (wake.item_id.as_str(), "wake_failed", "dm")
    );
    assert_eq!(notice.reply_to.as_ref(), Some(&slack_target("D1", "")));

    // When the agent posts its one line there, the notice is settled.
    sends.confirm(confirm("1700000002.000100", "")).await.expect("confirm");
    let claimed = wakes.claim(claim("w1")).await.expect("claim").into_inner();
    assert!(claimed.notices_owed.is_empty(), "{claimed:?}");

    // Analytics counts the notice owed and settled.
    let channel = server.channel().await;
    let mut analytics = api::analytics_client::AnalyticsClient::with_interceptor(channel, bearer(ANALYTICS_TOKEN));
    let counts = analytics.counts(api::AnalyticsCountsRequest::default()).await.expect("counts").into_inner();
    let total = counts.total.expect("a total");
    assert_eq!((total.failure_notices_owed, total.failure_notices_settled), (1, 1), "{total:?}");
}

async fn do_not_contact(backend: Backend) {
    let options = ServerOptions { tables: "[doNotContact]\nT1 = [\"U9\"]\n".into(), ..ServerOptions::default() };
    let mut server = Server::start_on(backend, options);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let not_contacted = |response: &api::SendResponse| match &response.verdict {
        Some(api::send_response::Verdict::NotContacted(refused)) => {
            Some((refused.reason.clone(), refused.user_id.clone()))
        }
        _ => None,
    };
    ingest.append(slack_message(&["ada"], "D9", "1700000001.000100", "", "U9", "hi ada")).await.expect("append");
    ingest.append(slack_message(&["ada"], "D1", "1700000002.000100", "", "U1", "hi ada")).await.expect("append");

    // A DM with the listed person is refused; one with another person is decided as usual.
    let dm_listed = sends.send(send_request("ada", slack_target("D9", ""))).await.expect("send").into_inner();
    assert_eq!(not_contacted(&dm_listed), Some(("listed".into(), "U9".into())), "{dm_listed:?}");
    let dm_other = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("send").into_inner();
    assert!(matches!(dm_other.verdict, Some(api::send_response::Verdict::Allowed(_))), "{dm_other:?}");
    // A DM nobody wrote in cannot be checked; a mention of the listed person is refused anywhere.
    let unknown = sends.send(send_request("ada", slack_target("D5", ""))).await.expect("send").into_inner();
    assert_eq!(not_contacted(&unknown), Some(("could_not_verify".into(), String::new())));
    let mention = api::SendRequest {
        mentioned_user_ids: vec!["U1".into(), "U9".into()],
        ..send_request("ada", slack_target("C1", ""))
    };
    let mentioned = sends.send(mention).await.expect("send").into_inner();
    assert_eq!(not_contacted(&mentioned), Some(("listed".into(), "U9".into())));
    // A malformed mention is refused naming the field.
    let bad =
        api::SendRequest { mentioned_user_ids: vec!["U 1".into()], ..send_request("ada", slack_target("C1", "")) };
    let refused = sends.send(bad).await.expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("mentioned_user_ids"), "{}", refused.message());

    // The list lives in the log: after a restart the same send is refused again; analytics
    // counts the refusals.
    server.restart();
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let again = sends.send(send_request("ada", slack_target("D9", ""))).await.expect("send").into_inner();
    assert_eq!(not_contacted(&again).map(|(reason, _)| reason), Some("listed".into()));
    let channel = server.channel().await;
    let mut analytics = api::analytics_client::AnalyticsClient::with_interceptor(channel, bearer(ANALYTICS_TOKEN));
    let counts = analytics.counts(api::AnalyticsCountsRequest::default()).await.expect("counts").into_inner();
    assert_eq!(counts.total.expect("a total").sends_not_contacted, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_to_a_listed_person_is_refused_before_the_hold_on_the_embedded_log() {
    do_not_contact(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_to_a_listed_person_is_refused_before_the_hold_on_jetstream() {
    do_not_contact(Backend::JetStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dm_wake_owes_a_notice_until_the_agent_posts_on_the_embedded_log() {
    failure_notice_owed(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dm_wake_owes_a_notice_until_the_agent_posts_on_jetstream() {
    failure_notice_owed(Backend::JetStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_send_after_its_post_answers_already_posted_on_the_embedded_log() {
    posted_do_not_resend(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_send_after_its_post_answers_already_posted_on_jetstream() {
    posted_do_not_resend(Backend::JetStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slack_thread_stop_removes_the_threads_queued_input_on_the_embedded_log() {
    slack_thread_stop(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slack_thread_stop_removes_the_threads_queued_input_on_jetstream() {
    slack_thread_stop(Backend::JetStream).await;
}
