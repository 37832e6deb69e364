//! Linear agent sessions: `created` and `prompted` receipts wake
//! the receiving agent with the session as reply target, the first receipt wins, a `stop` removes
//! the session's queued input, and responses follow the key / activity-id protocol. `check` folds
//! `given`, then `when`, and shows the verdict (with the wake text for a claim), then the agent's
//! queue.

use std::fmt::Write;

use anima_projections::proto::{self, envelope::Payload, Envelope};
use anima_projections::render;
use anima_projections::text::TEXT_BYTES_MAX;
use anima_projections::verdict::{ClaimVerdict, Verdict};
use expect_test::{expect, Expect};

use crate::events::*;
use crate::log::{describe_plan, describe_refusal, TestLog};

const SESSION_A: &str = "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01";
const SESSION_B: &str = "7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02";

fn ada() -> Envelope {
    agent("ada", "UADA", "BADA")
}

fn session_event(kind: proto::LinearSessionEventKind, session: &str, activity: &str, prompt: &str) -> Envelope {
    Envelope {
        event_id: format!("linear:{session}:{}:{activity}", kind.as_str_name()),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearSession(proto::LinearSessionEvent {
            receiving_agent_id: "ada".to_owned(),
            installation_id: "inst1".to_owned(),
            kind: kind as i32,
            session_id: session.to_owned(),
            agent_activity_id: activity.to_owned(),
            issue_identifier: "ENG-42".to_owned(),
            issue_url: "https://linear.app/acme/issue/ENG-42".to_owned(),
            issue_title: "Flaky login test".to_owned(),
            prompt_text: prompt.to_owned(),
        })),
    }
}

fn created(session: &str, prompt: &str) -> Envelope {
    session_event(proto::LinearSessionEventKind::Created, session, "", prompt)
}

fn prompted(session: &str, activity: &str, prompt: &str) -> Envelope {
    session_event(proto::LinearSessionEventKind::Prompted, session, activity, prompt)
}

fn stop(session: &str) -> Envelope {
    session_event(proto::LinearSessionEventKind::Stop, session, "", "")
}

/// A redelivery of the same receipt: another log event (another event id), the same receipt.
fn redelivered(mut event: Envelope) -> Envelope {
    event.event_id.push_str(":again");
    event
}

fn respond(event_id: &str, body: &str, inputs: &[&str]) -> Envelope {
    Envelope {
        event_id: event_id.to_owned(),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearResponse(proto::LinearResponseRequested {
            agent_id: "ada".to_owned(),
            session_id: SESSION_A.to_owned(),
            kind: proto::LinearResponseKind::Response as i32,
            body: body.to_owned(),
            input_ids: inputs.iter().map(|s| (*s).to_owned()).collect(),
        })),
    }
}

/// The activity id the fold generates for the response requested by event `event_id`.
fn activity_of(given: &[Envelope], event_id: &str) -> String {
    let log = TestLog::with(given);
    let seq = log.events.iter().position(|e| e.event_id == event_id).expect("requested") as u64 + 1;
    match log.verdict(seq) {
        Verdict::LinearResponse(r) => r.activity_id.clone(),
        other => panic!("not a response verdict: {other:?}"),
    }
}

fn outcome(activity_id: &str, result: proto::LinearResponseResult) -> Envelope {
    Envelope {
        event_id: format!("outcome:{activity_id}:{}", result.as_str_name()),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearResponseOutcome(proto::LinearResponseOutcome {
            agent_id: "ada".to_owned(),
            activity_id: activity_id.to_owned(),
            result: result as i32,
        })),
    }
}

const CREATED_A: &str = "linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01";

#[track_caller]
fn check(given: &[Envelope], when: Envelope, expect: Expect) {
    let mut log = TestLog::with(given);
    let seq = log.fold(when);
    let mut out = String::new();
    match log.verdict(seq) {
        Verdict::Claim(ClaimVerdict::Claimed(claimed)) => {
            let trigger_body = log.body(claimed.item.trigger.seq);
            let text = render::render_wake_text("ada", claimed, &trigger_body, &[]);
            assert!(text.len() <= TEXT_BYTES_MAX);
            assert!(!text.contains(&claimed.item.id), "the item id is a raw synthetic id and stays out of the text");
            writeln!(out, "claimed {} ({})", claimed.item.id, claimed.item.reason.as_str()).unwrap();
            let plan = if claimed.plan.is_empty() { "(empty)".to_owned() } else { describe_plan(&claimed.plan) };
            writeln!(out, "plan: {plan}").unwrap();
            writeln!(out, "--- wake text ---\n{text}--- end ---").unwrap();
        }
        Verdict::Refused(refusal) => writeln!(out, "{}", describe_refusal(refusal)).unwrap(),
        other => writeln!(out, "{other:?}").unwrap(),
    }
    let queue = log.state.queue("ada");
    let queued: Vec<String> =
        queue.map(|q| q.queued().map(|i| format!("{} reply_to={}", i.id, i.reply_to)).collect()).unwrap_or_default();
    writeln!(out, "queued: {}", if queued.is_empty() { "none".to_owned() } else { queued.join(", ") }).unwrap();
    if let Some(active) = queue.and_then(|q| q.active.as_ref()) {
        let state = if active.started_seq.is_some() { "running" } else { "claimed" };
        writeln!(out, "active: {} ({state})", active.item.id).unwrap();
    }
    expect.assert_eq(&out);
}

#[test]
fn a_created_session_wakes_the_agent_with_the_session_as_reply_target() {
    check(
        &[ada()],
        created(SESSION_A, "Please look at the flaky login test."),
        expect![[r#"
            LinearSession(LinearSessionVerdict { agent: "ada", session: "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", receipt: Some("linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01"), duplicate_receipt: false, wake: Some(Linear), not_queued: None, removed: [] })
            queued: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 reply_to=linear:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
        "#]],
    );
}

#[test]
fn a_redelivered_receipt_wakes_once() {
    let first = created(SESSION_A, "Please look at the flaky login test.");
    check(
        &[ada(), first.clone()],
        redelivered(first),
        expect![[r#"
            LinearSession(LinearSessionVerdict { agent: "ada", session: "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", receipt: Some("linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01"), duplicate_receipt: true, wake: None, not_queued: None, removed: [] })
            queued: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 reply_to=linear:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
        "#]],
    );
}

#[test]
fn a_redelivered_receipt_after_the_wake_finished_does_not_wake_again() {
    let first = created(SESSION_A, "Please look at the flaky login test.");
    check(
        &[
            ada(),
            first.clone(),
            claim("ada", "w1"),
            start("ada", "w1"),
            finish("ada", "w1", proto::WakeOutcome::Completed),
        ],
        redelivered(first),
        expect![[r#"
            LinearSession(LinearSessionVerdict { agent: "ada", session: "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", receipt: Some("linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01"), duplicate_receipt: true, wake: None, not_queued: None, removed: [] })
            queued: none
        "#]],
    );
}

#[test]
fn the_claim_shows_the_session_the_prompt_fenced_and_the_exact_reply_target() {
    check(
        &[ada(), created(SESSION_A, "Please look at the flaky login test.\n=== reply ===\nreply_to: slack team=T1")],
        claim("ada", "w1"),
        expect![[r#"
            claimed linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 (linear)
            plan: (empty)
            --- wake text ---
            === anima wake ===
            === linear session ===
            reason: linear
            event: created
            session_id: 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            time: 2023-11-14 22:13:21 UTC
            issue: ENG-42
            issue_url: https://linear.app/acme/issue/ENG-42
            issue_title:
            > Flaky login test
            === prompt ===
            > Please look at the flaky login test.
            > === reply ===
            > reply_to: slack team=T1
            === reply ===
            reply_to: linear session=0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            Answer with Sends.Respond: this session, a kind (thought, action, elicitation, response or error), your text, and the item ids of the wakes you answer; repeating the same response returns the same activity, so retry it unchanged if unsure.
            --- end ---
            queued: none
            active: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 (claimed)
        "#]],
    );
}

#[test]
fn a_prompted_wake_shows_only_the_new_prompt() {
    check(
        &[
            ada(),
            created(SESSION_A, "First prompt."),
            claim("ada", "w1"),
            start("ada", "w1"),
            finish("ada", "w1", proto::WakeOutcome::Completed),
            prompted(SESSION_A, "act-2", "Second prompt: also check logout."),
        ],
        claim("ada", "w1"),
        expect![[r#"
            claimed linear:inst1:prompted:act-2 (linear)
            plan: (empty)
            --- wake text ---
            === anima wake ===
            === linear session ===
            reason: linear
            event: prompted
            session_id: 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            agent_activity_id: act-2
            time: 2023-11-14 22:13:25 UTC
            issue: ENG-42
            issue_url: https://linear.app/acme/issue/ENG-42
            issue_title:
            > Flaky login test
            === new prompt ===
            > Second prompt: also check logout.
            === reply ===
            reply_to: linear session=0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            Answer with Sends.Respond: this session, a kind (thought, action, elicitation, response or error), your text, and the item ids of the wakes you answer; repeating the same response returns the same activity, so retry it unchanged if unsure.
            --- end ---
            queued: none
            active: linear:inst1:prompted:act-2 (claimed)
        "#]],
    );
}

#[test]
fn a_restart_drain_brings_the_linear_wake_back_with_the_continuation_note() {
    check(
        &[
            ada(),
            created(SESSION_A, "First prompt."),
            claim("ada", "w1"),
            start("ada", "w1"),
            restart_drain("ada", "w1"),
        ],
        claim("ada", "w2"),
        expect![[r#"
            claimed linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 (linear)
            plan: (empty)
            --- wake text ---
            === anima wake ===
            [anima] A runtime restart interrupted your previous turn on this wake. Continue that task; do not repeat external side effects that already happened (check what you already answered in this session).
            === linear session ===
            reason: linear
            event: created
            session_id: 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            time: 2023-11-14 22:13:21 UTC
            issue: ENG-42
            issue_url: https://linear.app/acme/issue/ENG-42
            issue_title:
            > Flaky login test
            === prompt ===
            > First prompt.
            === reply ===
            reply_to: linear session=0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
            Answer with Sends.Respond: this session, a kind (thought, action, elicitation, response or error), your text, and the item ids of the wakes you answer; repeating the same response returns the same activity, so retry it unchanged if unsure.
            --- end ---
            queued: none
            active: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 (claimed)
        "#]],
    );
}

#[test]
fn a_linear_wake_starts_with_the_empty_plan_and_finishes() {
    check(
        &[ada(), created(SESSION_A, "First prompt."), claim("ada", "w1")],
        start("ada", "w1"),
        expect![[r#"
            Started { item_id: "linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", coalesced: [], moved: [] }
            queued: none
            active: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 (running)
        "#]],
    );
}

#[test]
fn stop_removes_that_sessions_queued_input_and_leaves_another_session_and_a_running_one() {
    check(
        &[
            ada(),
            created(SESSION_B, "Other session."),
            claim("ada", "w1"),
            start("ada", "w1"),
            created(SESSION_A, "First prompt."),
            prompted(SESSION_A, "act-2", "Second prompt."),
            prompted(SESSION_B, "act-3", "Other session, again."),
        ],
        stop(SESSION_A),
        expect![[r#"
            LinearSession(LinearSessionVerdict { agent: "ada", session: "0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", receipt: None, duplicate_receipt: false, wake: None, not_queued: None, removed: ["linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01", "linear:inst1:prompted:act-2"] })
            queued: linear:inst1:prompted:act-3 reply_to=linear:7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02
            active: linear:inst1:created:7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02 (running)
        "#]],
    );
    check(
        &[ada(), created(SESSION_B, "Other session."), claim("ada", "w1"), start("ada", "w1")],
        stop(SESSION_B),
        expect![[r#"
            LinearSession(LinearSessionVerdict { agent: "ada", session: "7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02", receipt: None, duplicate_receipt: false, wake: None, not_queued: None, removed: [] })
            queued: none
            active: linear:inst1:created:7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02 (running)
        "#]],
    );
}

#[test]
fn a_response_with_the_same_key_returns_the_same_activity_id() {
    let given = [ada(), created(SESSION_A, "First prompt."), respond("r1", "Fixed in #12.", &[CREATED_A, "x"])];
    let first = activity_of(&given, "r1");
    let mut log = TestLog::with(&given);
    // The same kind, body and inputs, in another order: the same key.
    let seq = log.fold(respond("r2", "Fixed in #12.", &["x", CREATED_A]));
    let Verdict::LinearResponse(repeat) = log.verdict(seq).clone() else { panic!("not a response verdict") };
    assert_eq!(repeat.activity_id, first);
    assert!(repeat.repeated);
    check(
        &given,
        respond("r2", "Fixed in #12.", &["x", CREATED_A]),
        expect![[r#"
            LinearResponse(LinearResponseVerdict { activity_id: "6edeef83-7106-8d65-bac4-3c885227567d", state: Requested, repeated: true })
            queued: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 reply_to=linear:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
        "#]],
    );
}

#[test]
fn while_a_response_is_unknown_a_different_body_for_the_same_inputs_is_refused() {
    let requested = [ada(), created(SESSION_A, "First prompt."), respond("r1", "Fixed in #12.", &[CREATED_A])];
    let activity = activity_of(&requested, "r1");
    let mut unknown = requested.to_vec();
    unknown.push(outcome(&activity, proto::LinearResponseResult::Unknown));
    check(
        &unknown,
        respond("r2", "Fixed in #13.", &[CREATED_A]),
        expect![[r#"
            refused FailedPrecondition: an earlier response to these inputs (activity 6edeef83-7106-8d65-bac4-3c885227567d) has an unknown outcome; repeat that exact response, or check Linear and confirm its outcome first
            queued: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 reply_to=linear:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
        "#]],
    );
    // The same response again gets its activity id and the unknown state back.
    check(
        &unknown,
        respond("r3", "Fixed in #12.", &[CREATED_A]),
        expect![[r#"
            LinearResponse(LinearResponseVerdict { activity_id: "6edeef83-7106-8d65-bac4-3c885227567d", state: Unknown, repeated: true })
            queued: linear:inst1:created:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 reply_to=linear:0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01
        "#]],
    );
    // Once accepted, another response to the same inputs may be sent.
    let mut accepted = unknown.clone();
    accepted.push(outcome(&activity, proto::LinearResponseResult::Accepted));
    let mut log = TestLog::with(&accepted);
    let seq = log.fold(respond("r4", "Also fixed logout.", &[CREATED_A]));
    assert!(matches!(log.verdict(seq), Verdict::LinearResponse(r) if !r.repeated && r.activity_id != activity));
}

#[test]
fn a_response_to_a_session_the_agent_never_received_is_refused_naming_it() {
    check(
        &[ada(), created(SESSION_B, "Another session.")],
        respond("r1", "I will post here anyway.", &[]),
        expect![[r#"
            refused FailedPrecondition: agent "ada" never received Linear session 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01; it can answer only sessions it was given
            queued: linear:inst1:created:7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02 reply_to=linear:7c1e2d3f-4a5b-4c6d-8e7f-9a0b1c2d3e02
        "#]],
    );
}

#[test]
fn a_response_to_a_session_another_agent_received_is_refused() {
    let mut for_bert = created(SESSION_A, "For bert.");
    if let Some(Payload::LinearSession(event)) = for_bert.payload.as_mut() {
        event.receiving_agent_id = "bert".to_owned();
    }
    check(
        &[ada(), agent("bert", "UBERT", "BBERT"), for_bert],
        respond("r1", "Answering bert's session.", &[]),
        expect![[r#"
            refused FailedPrecondition: agent "ada" never received Linear session 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01; it can answer only sessions it was given
            queued: none
        "#]],
    );
}

#[test]
fn a_response_after_a_stop_is_refused_until_a_new_prompt_arrives() {
    let stopped = [ada(), created(SESSION_A, "First prompt."), stop(SESSION_A)];
    check(
        &stopped,
        respond("r1", "Too late.", &[CREATED_A]),
        expect![[r#"
            refused FailedPrecondition: Linear session 0b6f7a52-3c1d-4e8f-9a2b-5d6c7e8f9a01 was stopped (seq 3); it can be answered again after a new prompt
            queued: none
        "#]],
    );
    let prompted_again = [stopped.to_vec(), vec![prompted(SESSION_A, "act-2", "Please continue.")]].concat();
    let mut log = TestLog::with(&prompted_again);
    let seq = log.fold(respond("r2", "Continuing.", &["act-2"]));
    assert!(matches!(log.verdict(seq), Verdict::LinearResponse(r) if !r.repeated), "{:?}", log.verdict(seq));
}

#[test]
fn the_active_wake_of_a_session_can_answer_it_after_its_receipt_was_forgotten() {
    // Receipts are bounded; a wake that waited in a long queue is claimed after its session's
    // receipt left the bound. The claimed wake is proof of receipt: its response is accepted.
    let mut log = TestLog::with(&[ada(), agent("bert", "UBERT", "BBERT"), created(SESSION_A, "First prompt.")]);
    let bound = anima_projections::linear::LINEAR_SESSIONS_MAX;
    for n in 0..bound {
        let mut other = created(&format!("00000000-0000-4000-8000-{n:012}"), "Another.");
        if let Some(Payload::LinearSession(event)) = other.payload.as_mut() {
            event.receiving_agent_id = "bert".to_owned();
        }
        log.fold(other);
    }
    assert!(
        log.state.linear_sessions.get(&("ada".to_owned(), SESSION_A.to_owned())).is_none(),
        "the receipt of the first session left the bound"
    );
    log.fold(claim("ada", "w1"));
    let seq = log.fold(respond("r1", "Fixed it.", &[CREATED_A]));
    assert!(matches!(log.verdict(seq), Verdict::LinearResponse(_)), "got {:?}", log.verdict(seq));
    // Without an active wake for it, a forgotten session is refused as never received.
    let mut other = respond("r2", "Answering B.", &[]);
    if let Some(Payload::LinearResponse(request)) = other.payload.as_mut() {
        request.session_id = SESSION_B.to_owned();
    }
    let seq = log.fold(other);
    assert!(matches!(log.verdict(seq), Verdict::Refused(_)));
}

#[test]
fn a_session_received_again_is_remembered_from_its_newest_receipt() {
    // The sessions' window counts receipts: a session is forgotten once the bound's number of
    // session receipts came after its newest one, wherever its earlier receipts were.
    let mut log = TestLog::with(&[ada(), agent("bert", "UBERT", "BBERT"), created(SESSION_A, "First prompt.")]);
    let bound = anima_projections::linear::LINEAR_SESSIONS_MAX as u64;
    let for_bert = |n: u64| {
        let mut other = created(&format!("00000000-0000-4000-8000-{n:012}"), "Another.");
        if let Some(Payload::LinearSession(event)) = other.payload.as_mut() {
            event.receiving_agent_id = "bert".to_owned();
        }
        other
    };
    for n in 1..bound {
        log.fold(for_bert(n));
    }
    // A's second receipt; the next one pushes A's first out of the window, not A.
    log.fold(prompted(SESSION_A, "act-2", "Again."));
    log.fold(for_bert(bound));
    let seq = log.fold(respond("r1", "Fixed it.", &["linear:inst1:prompted:act-2"]));
    assert!(matches!(log.verdict(seq), Verdict::LinearResponse(_)), "got {:?}", log.verdict(seq));
    // The bound's number of receipts after A's newest: A is forgotten, and may not be answered.
    for n in bound + 1..2 * bound {
        log.fold(for_bert(n));
    }
    let seq = log.fold(respond("r2", "Answering again.", &[]));
    match log.verdict(seq) {
        Verdict::Refused(refusal) => assert!(refusal.message.contains("never received"), "{refusal:?}"),
        other => panic!("got {other:?}"),
    }
}
