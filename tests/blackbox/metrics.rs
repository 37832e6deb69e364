//! Prometheus metrics of the real binary: started with `--metrics-listen`, driven through a wake
//! and a send that is held then allowed, refused calls, and scraped over HTTP before and after.

use std::collections::BTreeMap;

use anima_gateway::api;
use tonic::Code;

use crate::fixture::*;

/// The samples of an OpenMetrics text, by series (`name{labels}`).
fn samples(text: &str) -> BTreeMap<String, f64> {
    assert!(text.ends_with("# EOF\n"), "an OpenMetrics exposition ends with # EOF: {text}");
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("a sample line: {line}"));
            (series.to_owned(), value.parse::<f64>().unwrap_or_else(|_| panic!("a number: {line}")))
        })
        .collect()
}

#[track_caller]
fn value(samples: &BTreeMap<String, f64>, series: &str) -> f64 {
    *samples.get(series).unwrap_or_else(|| panic!("{series} is missing from {samples:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_sends_wakes_refusals_appends_and_the_fold_lag() {
    let server = Server::start_with(ServerOptions {
        args: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..ServerOptions::default()
    });
    let before = samples(&server.scrape_metrics().await);
    // At start-up: the configured agents were appended and folded; nothing sent or refused yet.
    let last_before = value(&before, "anima_log_last_seq");
    assert!(last_before >= 2.0, "two configured agents: {before:#?}");
    assert_eq!(value(&before, "anima_fold_applied_seq"), last_before);
    assert_eq!(value(&before, "anima_fold_lag_events"), 0.0);
    assert_eq!(value(&before, "anima_wakes_claimed_total"), 0.0);
    assert_eq!(value(&before, r#"anima_sends_total{verdict="held"}"#), 0.0);
    assert_eq!(value(&before, r#"anima_wakes_finished_total{outcome="failed"}"#), 0.0);
    let appends_before = value(&before, r#"anima_log_append_seconds_count{call="append"}"#);

    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    let dm = slack_target("D1", "");

    // A DM wakes ada; the wake is claimed and started.
    ingest.append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "hello ada")).await.expect("append");
    let claim = api::ClaimRequest { agent_id: "ada".into(), worker_id: "worker".into(), ..Default::default() };
    let wake = wakes.claim(claim).await.expect("claim").into_inner().wake.expect("a wake");
    wakes
        .start(api::StartRequest {
            agent_id: "ada".into(),
            worker_id: "worker".into(),
            item_id: wake.item_id.clone(),
            plan: wake.plan.clone(),
            request_id: String::new(),
        })
        .await
        .expect("start");

    // A foreign message arrives: the send is held; the resend is allowed.
    ingest.append(slack_message(&["ada"], "D1", "1700000002.000100", "", "U1", "news")).await.expect("append");
    let held = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert!(matches!(held.verdict, Some(api::send_response::Verdict::Held(_))), "{held:?}");
    let allowed = sends.send(send_request("ada", dm.clone())).await.expect("send").into_inner();
    assert!(matches!(allowed.verdict, Some(api::send_response::Verdict::Allowed(_))), "{allowed:?}");

    let finished = wakes
        .finish(api::FinishRequest {
            agent_id: "ada".into(),
            worker_id: "worker".into(),
            item_id: wake.item_id.clone(),
            outcome: api::WakeOutcome::Completed as i32,
            ..Default::default()
        })
        .await
        .expect("finish")
        .into_inner();

    // Refused: a send for another agent (twice), an unknown token, and bad input.
    for _ in 0..2 {
        let error = sends.send(send_request("bob", dm.clone())).await.unwrap_err();
        assert_eq!(error.code(), Code::PermissionDenied);
    }
    let mut stranger = server.ingest("not-a-configured-token").await;
    let error = stranger.append(slack_message(&["ada"], "D1", "1700000003.000100", "", "U1", "x")).await.unwrap_err();
    assert_eq!(error.code(), Code::Unauthenticated);
    let error = ingest.append(slack_message(&["ada"], "D1", "yesterday", "", "U1", "x")).await.unwrap_err();
    assert_eq!(error.code(), Code::InvalidArgument);

    let after = samples(&server.scrape_metrics().await);
    let expected = [
        (r#"anima_sends_total{verdict="held"}"#, 1.0),
        (r#"anima_sends_total{verdict="allowed"}"#, 1.0),
        ("anima_wakes_claimed_total", 1.0),
        ("anima_wakes_started_total", 1.0),
        (r#"anima_wakes_finished_total{outcome="completed"}"#, 1.0),
        (r#"anima_grpc_refused_total{rpc="/anima.v1.Sends/Send",code="permission_denied"}"#, 2.0),
        (r#"anima_grpc_refused_total{rpc="/anima.v1.Ingest/Append",code="unauthenticated"}"#, 1.0),
        (r#"anima_grpc_refused_total{rpc="/anima.v1.Ingest/Append",code="invalid_argument"}"#, 1.0),
        // Every call, by the usual gRPC server metric names.
        (
            r#"grpc_server_handled_total{grpc_service="anima.v1.Sends",grpc_method="Send",grpc_code="PERMISSION_DENIED"}"#,
            2.0,
        ),
        (r#"grpc_server_handled_total{grpc_service="anima.v1.Wakes",grpc_method="Claim",grpc_code="OK"}"#, 1.0),
        (r#"grpc_server_handling_seconds_count{grpc_service="anima.v1.Wakes",grpc_method="Claim"}"#, 1.0),
    ];
    for (series, want) in expected {
        assert_eq!(value(&after, series), want, "{series} in {after:#?}");
    }
    // Successful calls are not refusals.
    assert!(!after.keys().any(|k| k.contains(r#"rpc="/anima.v1.Wakes/Claim""#)), "{after:#?}");

    // The fold has applied the finish before it answered, and nothing was appended since.
    let last = finished.finished_at_seq as f64;
    assert_eq!(value(&after, "anima_log_last_seq"), last);
    assert_eq!(value(&after, "anima_fold_applied_seq"), last);
    assert_eq!(value(&after, "anima_fold_lag_events"), 0.0);

    // Every append between the scrapes was timed: one append call per stored event here.
    let appends_after = value(&after, r#"anima_log_append_seconds_count{call="append"}"#);
    assert_eq!(appends_after - appends_before, last - last_before, "{after:#?}");
    let within_infinity = value(&after, r#"anima_log_append_seconds_bucket{le="+Inf",call="append"}"#);
    assert_eq!(within_infinity, appends_after);
    assert!(value(&after, r#"anima_log_append_seconds_sum{call="append"}"#) > 0.0);

    // The fold's memory beside its budget: the default budget's share for the state (1024 MiB:
    // three quarters, less sled's 128, the checkpoint store's 64 and the body cache's 64), and
    // the state's own estimate,
    // which the runner takes again after each checkpoint (this config checkpoints every 200 ms).
    let budget = value(&after, "anima_state_budget_bytes");
    assert_eq!(budget, (512u64 << 20) as f64);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let estimate = loop {
        let now = samples(&server.scrape_metrics().await);
        let estimate = value(&now, "anima_state_estimate_bytes");
        if estimate > 0.0 {
            break estimate;
        }
        assert!(std::time::Instant::now() < deadline, "no state estimate after a checkpoint: {now:#?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert!(estimate < budget, "a few agents and surfaces estimated at {estimate} bytes");

    // The data dir's files on disk: sled's file (the embedded log) and the checkpoint store's
    // (in `checkpoints/`), as `du` counts them (blocks written).
    use std::os::unix::fs::MetadataExt as _;
    let on_disk = value(&samples(&server.scrape_metrics().await), "anima_data_dir_bytes");
    let data_dir = server.data_dir();
    let db_file = std::fs::metadata(data_dir.join("db")).expect("the data dir's sled file").blocks() as f64 * 512.0;
    let journal = std::fs::read_dir(data_dir.join("checkpoints"))
        .expect("the checkpoint store")
        .flatten()
        .filter(|entry| entry.file_name().to_string_lossy().ends_with(".jnl"))
        .map(|entry| entry.metadata().expect("journal").blocks() as f64 * 512.0)
        .sum::<f64>();
    assert!(db_file > 0.0 && journal > 0.0, "sled's file {db_file} bytes, the checkpoint journals {journal}");
    assert!(on_disk >= db_file + journal, "{on_disk} bytes reported, sled's file {db_file}, the journals {journal}");
}

/// The steps of a start that depend on the history: the checkpoint store's open, the journal it
/// read (none on a new data dir; after a clean restart, the journal the stop left: its bytes up
/// to the zeros a journal file is made with), and the restore after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_give_the_steps_of_a_start() {
    let mut server = Server::start_with(ServerOptions {
        args: vec!["--metrics-listen".into(), "127.0.0.1:0".into()],
        ..ServerOptions::default()
    });
    let first = samples(&server.scrape_metrics().await);
    assert!(value(&first, "anima_checkpoint_store_open_seconds") > 0.0, "{first:#?}");
    assert_eq!(value(&first, "anima_checkpoint_journal_read_at_open_bytes"), 0.0, "a new data dir has no journal");
    assert!(value(&first, "anima_restore_seconds") > 0.0, "{first:#?}");

    server.stop();
    let journals: Vec<_> = std::fs::read_dir(server.data_dir().join("checkpoints"))
        .expect("the checkpoint store")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "jnl"))
        .collect();
    assert_eq!(journals.len(), 1, "one journal: {journals:?}");
    let bytes = std::fs::read(&journals[0]).expect("the journal");
    let written = bytes.iter().rposition(|&b| b != 0).map_or(0, |last| last + 1) as f64;
    server.restart();
    let again = samples(&server.scrape_metrics().await);
    let read = value(&again, "anima_checkpoint_journal_read_at_open_bytes");
    assert!(written > 0.0, "the stop left the registrations and the last checkpoint in the journal");
    assert_eq!(read, written, "the gauge gives the journal the open read");
    assert!(value(&again, "anima_checkpoint_store_open_seconds") > 0.0, "{again:#?}");
    assert!(value(&again, "anima_restore_seconds") > 0.0, "{again:#?}");
}
