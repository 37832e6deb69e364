//! The generic chat platform end to end through the binary: a p2p chat message wakes the agent
//! (`dm`), the wake answers in the chat, two foreign messages hold the next send, the resend
//! posts and its confirmation journals the agent's own row; own rows (by `chat_user_id`) never
//! wake; group chats are muted with a chat target, p2p chats cannot be.

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

/// A message in chat `chat` of tenant `t1`, received by ada's app.
fn chat_message(kind: api::ChatKind, chat: &str, message_id: &str, sender: &str, text: &str) -> api::AppendRequest {
    api::AppendRequest {
        correlation_id: message_id.to_owned(),
        observation: Some(api::append_request::Observation::ChatMessage(api::ChatMessage {
            receiving_agent_ids: vec!["ada".into()],
            tenant_id: "t1".into(),
            chat_id: chat.into(),
            chat_kind: kind as i32,
            message_id: message_id.into(),
            sender_id: sender.into(),
            sender_name: format!("Person {sender}"),
            text: text.into(),
            ..Default::default()
        })),
    }
}

fn chat_target(chat: &str, thread: &str) -> api::ReplyTarget {
    api::ReplyTarget {
        target: Some(api::reply_target::Target::Chat(api::ChatTarget {
            tenant_id: "t1".into(),
            chat_id: chat.into(),
            thread_id: thread.into(),
        })),
    }
}

async fn scenario(backend: Backend) {
    let server = Server::start(backend);
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;

    let first = chat_message(api::ChatKind::P2p, "p1", "om_1", "ou_uma", "can you check the deploy?");
    let appended = ingest.append(first.clone()).await.expect("append").into_inner();
    let outcome = &appended.outcomes[0];
    assert_eq!((outcome.surface.as_str(), outcome.ordinal, outcome.wake_reason.as_str()), ("chat:t1:p1", 1, "dm"));
    let retry = ingest.append(first).await.expect("retry").into_inner();
    assert!(retry.outcomes[0].duplicate_event, "a connector retry dedupes in the log");

    let wake = wakes
        .claim(api::ClaimRequest { agent_id: "ada".into(), worker_id: "w1".into(), ..Default::default() })
        .await
        .expect("claim")
        .into_inner()
        .wake
        .expect("a wake to claim");
    assert_eq!((wake.item_id.as_str(), wake.reason.as_str()), ("chat:t1:p1:om_1", "dm"));
    assert!(wake.text.contains("chat_id: p1\nthread_id: -\nmessage_id: om_1\n"), "{}", wake.text);
    assert!(wake.text.contains("> can you check the deploy?"), "{}", wake.text);
    let chat = chat_target("p1", "");
    assert_eq!(wake.reply_to.as_ref(), Some(&chat), "a p2p chat is answered in the chat");
    assert_eq!(wake.plan.len(), 1, "a p2p chat has no response thread");
    wakes
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: "w1".into(),
            item_id: wake.item_id.clone(),
            plan: wake.plan.clone(),
            request_id: String::new(),
        })
        .await
        .expect("start");

    // Two foreign messages: the send is held with both; the resend posts.
    for (id, text) in [("om_2", "one more thing"), ("om_3", "and another")] {
        ingest.append(chat_message(api::ChatKind::P2p, "p1", id, "ou_uma", text)).await.expect("append");
    }
    let response = sends.send(send_request("ada", chat.clone())).await.expect("send").into_inner();
    let Some(api::send_response::Verdict::Held(held)) = response.verdict else {
        panic!("expected a hold, got {response:?}");
    };
    assert_eq!(held.new_messages, 2);
    assert!(held.notice.contains("> one more thing") && held.notice.contains("> and another"), "{}", held.notice);
    let resend = sends.send(send_request("ada", chat.clone())).await.expect("send").into_inner();
    assert!(matches!(resend.verdict, Some(api::send_response::Verdict::Allowed(_))), "{resend:?}");

    // The post is confirmed with the platform's message id; `ts` is for Slack only.
    let confirm = api::SendsConfirmRequest {
        agent_id: "ada".into(),
        target: Some(chat.clone()),
        kind: api::SendKind::Message as i32,
        message_id: "om_4".into(),
        text: "on it".into(),
        ..Default::default()
    };
    let confirmed = sends.confirm(confirm.clone()).await.expect("confirm").into_inner();
    assert_eq!(confirmed.ordinal, 4);
    let error = sends
        .confirm(api::SendsConfirmRequest { ts: "1700000001.000100".into(), ..confirm })
        .await
        .expect_err("ts with a chat target");
    assert_eq!(error.code(), Code::InvalidArgument);

    // The platform echoes ada's post: it is her own row (by chat_user_id) and wakes nobody.
    let echo = ingest
        .append(chat_message(api::ChatKind::P2p, "p1", "om_4", "ou_ada", "on it"))
        .await
        .expect("append")
        .into_inner();
    assert!(echo.outcomes[0].duplicate_message && echo.outcomes[0].wake_reason.is_empty(), "{echo:?}");
    let own = ingest
        .append(chat_message(api::ChatKind::P2p, "p1", "om_5", "ou_ada", "and a follow-up"))
        .await
        .expect("append")
        .into_inner();
    assert_eq!((own.outcomes[0].ordinal, own.outcomes[0].wake_reason.as_str()), (5, ""));
    let after_own = sends.send(send_request("ada", chat.clone())).await.expect("send").into_inner();
    assert!(matches!(after_own.verdict, Some(api::send_response::Verdict::Allowed(_))), "own rows never hold");

    // Group chats: a top-level message wakes channel_follow; muting the chat stops that.
    let group = ingest
        .append(chat_message(api::ChatKind::Group, "g1", "om_10", "ou_uma", "anyone around?"))
        .await
        .expect("append")
        .into_inner();
    assert_eq!(group.outcomes[0].wake_reason, "channel_follow");
    let mut subscriptions = api::subscriptions_client::SubscriptionsClient::with_interceptor(
        server.channel().await,
        bearer(ADA_RUNTIME_TOKEN),
    );
    let group_chat = api::ChatTarget { tenant_id: "t1".into(), chat_id: "g1".into(), thread_id: String::new() };
    subscriptions
        .mute(api::MuteRequest { agent_id: "ada".into(), chat_target: Some(group_chat.clone()), ..Default::default() })
        .await
        .expect("mute");
    let list = subscriptions
        .list(api::SubscriptionsListRequest { agent_id: "ada".into(), ..Default::default() })
        .await
        .expect("list")
        .into_inner();
    let g1 = list.subscriptions.iter().find(|s| s.surface == "chat:t1:g1").expect("g1 listed");
    assert!(g1.member && g1.muted && g1.chat_target.as_ref() == Some(&group_chat) && g1.target.is_none(), "{g1:?}");
    let muted = ingest
        .append(chat_message(api::ChatKind::Group, "g1", "om_11", "ou_uma", "more chatter"))
        .await
        .expect("append")
        .into_inner();
    assert_eq!(muted.outcomes[0].wake_reason, "", "a muted chat does not wake");
    let p2p = api::ChatTarget { tenant_id: "t1".into(), chat_id: "p1".into(), thread_id: String::new() };
    let error = subscriptions
        .mute(api::MuteRequest { agent_id: "ada".into(), chat_target: Some(p2p), ..Default::default() })
        .await
        .expect_err("a p2p chat cannot be muted");
    assert_eq!(error.code(), Code::InvalidArgument);

    // Bounds: control characters in a chat id are refused at ingest, naming the field.
    let error = ingest
        .append(chat_message(api::ChatKind::Group, "g\u{7}1", "om_12", "ou_uma", "hi"))
        .await
        .expect_err("a control character");
    assert_eq!(error.code(), Code::InvalidArgument);
    assert!(error.message().starts_with("chat_id:"), "{}", error.message());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_on_the_embedded_log() {
    scenario(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_on_jetstream() {
    scenario(Backend::JetStream).await;
}
