//! The send-hold scenario of the foundation issue, end to end through the binary, on both
//! backends: sends, a DM wake claimed and started, holds with what arrived, resends, own posts,
//! concurrent claims, bad tokens and bad input, and persistence across a restart.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

fn held(response: &api::SendResponse) -> Option<&api::SendHeld> {
    match response.verdict.as_ref() {
        Some(api::send_response::Verdict::Held(held)) => Some(held),
        _ => None,
    }
}

fn allowed(response: &api::SendResponse) -> bool {
    matches!(response.verdict, Some(api::send_response::Verdict::Allowed(_)))
}

async fn scenario(backend: Backend) {
    let mut server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let dm = slack_target("D1", "");

    // A send into a DM the agent was never woken for is allowed.
    let first = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert!(allowed(&first), "{first:?}");

    // A DM from a person wakes the agent.
    let appended = ingest
        .append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "hello ada"))
        .await
        .expect("append")
        .into_inner();
    assert_eq!(appended.outcomes.len(), 1);
    assert_eq!(appended.outcomes[0].wake_reason, "dm");
    assert_eq!(appended.outcomes[0].ordinal, 1);
    assert_eq!(appended.outcomes[0].surface, "slack:T1:D1");

    // Two workers claim at once: exactly one gets the wake.
    let mut wakes_a = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut wakes_b = server.wakes(ADA_RUNTIME_TOKEN).await;
    let claim =
        |worker: &str| api::ClaimRequest { agent_id: "ada".into(), worker_id: worker.into(), ..Default::default() };
    let (a, b) = tokio::join!(wakes_a.claim(claim("worker-a")), wakes_b.claim(claim("worker-b")));
    let results = [a.map(|r| r.into_inner()), b.map(|r| r.into_inner())];
    let winners: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).filter_map(|r| r.wake.clone()).collect();
    assert_eq!(winners.len(), 1, "exactly one worker gets the wake: {results:?}");
    let losers: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(losers.len(), 1);
    assert_eq!(losers[0].code(), Code::Aborted, "{:?}", losers[0]);
    let wake = &winners[0];
    let worker = if results[0].as_ref().is_ok_and(|r| r.wake.is_some()) { "worker-a" } else { "worker-b" };
    assert_eq!(wake.reason, "dm");
    assert!(wake.text.contains("> hello ada"), "{}", wake.text);
    assert_eq!(wake.reply_to.as_ref(), Some(&dm));

    let started = wakes_a
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: worker.into(),
            item_id: wake.item_id.clone(),
            plan: wake.plan.clone(),
            request_id: String::new(),
        })
        .await;
    assert!(started.is_ok(), "{started:?}");

    // Two foreign messages arrive: the send is held, showing both.
    for (ts, text) in [("1700000002.000100", "first news"), ("1700000003.000100", "second news")] {
        ingest.append(slack_message(&["ada"], "D1", ts, "", "U1", text)).await.expect("append");
    }
    let response = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    let notice = held(&response).expect("held");
    assert_eq!((notice.new_messages, notice.shown, notice.omitted), (2, 2, 0));
    assert!(notice.notice.contains("> first news") && notice.notice.contains("> second news"), "{}", notice.notice);
    assert!(notice.notice.contains("send it again"), "{}", notice.notice);
    for word in ["blocked", "rejected", "failed"] {
        assert!(!notice.notice.to_lowercase().contains(word), "notice says {word}: {}", notice.notice);
    }

    // The resend posts.
    let resend = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert!(allowed(&resend), "{resend:?}");

    // 25 foreign messages: at most 20 shown, the rest counted.
    for n in 0..25 {
        let ts = format!("17000001{n:02}.000100");
        ingest.append(slack_message(&["ada"], "D1", &ts, "", "U2", &format!("burst {n}"))).await.expect("append");
    }
    let response = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    let notice = held(&response).expect("held");
    assert_eq!(notice.new_messages, 25);
    assert!(notice.shown <= 20 && notice.shown > 0);
    assert_eq!(notice.omitted, 25 - notice.shown);
    assert!(notice.notice.contains(&format!("{} older ones", notice.omitted)), "{}", notice.notice);
    assert!(notice.notice.contains("> burst 24") && !notice.notice.contains("> burst 0\n"));
    assert!(notice.notice.len() <= 16_384);

    // The agent's own confirmed post does not hold its next send.
    let confirm = sends
        .confirm(api::SendsConfirmRequest {
            agent_id: "ada".into(),
            target: Some(dm.clone()),
            kind: api::SendKind::Message as i32,
            ts: "1700000200.000100".into(),
            text: "my answer".into(),
            ..Default::default()
        })
        .await
        .expect("confirm")
        .into_inner();
    assert!(confirm.ordinal > 0);
    let after_own = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert!(allowed(&after_own), "{after_own:?}");

    // A wrong or missing token gets UNAUTHENTICATED and appends nothing.
    let before = after_own.decided_at_seq;
    let mut bad_ingest = server.ingest("not-a-configured-token").await;
    let error =
        bad_ingest.append(slack_message(&["ada"], "D1", "1700000300.000100", "", "U1", "sneaky")).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    let mut no_token = api::sends_client::SendsClient::new(server.channel().await);
    let error = no_token.send(send_request("ada", dm.clone())).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    // A runtime token for ada cannot send as bob; an analytics token cannot append.
    let error = sends.send(send_request("bob", dm.clone())).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    let mut bob_wakes = server.wakes(BOB_RUNTIME_TOKEN).await;
    let error = bob_wakes.claim(claim("bobs-worker")).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    let mut analytics = server.ingest(ANALYTICS_TOKEN).await;
    let error = analytics.append(slack_message(&["ada"], "D1", "1700000301.000100", "", "U1", "x")).await.unwrap_err();
    assert_eq!(error.code(), Code::PermissionDenied);
    // Bad input names the field; oversized text is RESOURCE_EXHAUSTED; neither is appended.
    let error = ingest.append(slack_message(&["ada"], "D1", "yesterday", "", "U1", "x")).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().starts_with("ts:"), "{}", error.message());
    let error = ingest.append(slack_message(&["nobody"], "D1", "1700000302.000100", "", "U1", "x")).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().contains("receiving_agent_ids"), "{}", error.message());
    let huge = "x".repeat(160_001);
    let error = ingest.append(slack_message(&["ada"], "D1", "1700000303.000100", "", "U1", &huge)).await.unwrap_err();
    assert_eq!(error.code(), Code::ResourceExhausted);
    let next = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert_eq!(next.decided_at_seq, before + 1, "refused calls appended nothing");

    // The same message redelivered (retry, app_mention) is one row and one wake at most.
    let mut retry = slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "hello ada");
    let again = ingest.append(retry.clone()).await.expect("append").into_inner();
    assert!(again.outcomes[0].duplicate_event);
    if let Some(api::append_request::Observation::SlackMessage(m)) = retry.observation.as_mut() {
        m.kind = api::SlackDeliveryKind::AppMention as i32;
    }
    let mention = ingest.append(retry).await.expect("append").into_inner();
    assert!(!mention.outcomes[0].duplicate_event && mention.outcomes[0].duplicate_message);
    assert_eq!(mention.outcomes[0].ordinal, 1);
    assert_eq!(mention.outcomes[0].wake_reason, "");

    // State survives a restart: a foreign message arrives, the server restarts, the send is held.
    ingest
        .append(slack_message(&["ada"], "D1", "1700000400.000100", "", "U3", "while you restart"))
        .await
        .expect("append");
    server.restart();
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let response = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    let notice = held(&response).expect("held after restart");
    assert_eq!(notice.new_messages, 1);
    assert!(notice.notice.contains("> while you restart"));
    let resend = sends.send(send_request("ada", dm)).await.expect("send").into_inner();
    assert!(allowed(&resend));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_hold_scenario_on_the_embedded_log() {
    scenario(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_hold_scenario_on_jetstream() {
    scenario(Backend::JetStream).await;
}
