//! The replay tool against the real binary: reading the log directly (an embedded data dir with
//! no server, or a JetStream stream) it gives the same answers as through the API while the
//! server runs, says which source it used, and `verify` passes on the stopped server's
//! checkpoint.

use anima_gateway::api;

use crate::fixture::*;

/// The incident: a DM wakes ada, she starts, a second DM arrives, her send is held, the resend
/// is allowed. Returns the sequence of the held send.
async fn incident(server: &Server) -> u64 {
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut wakes = server.wakes(ADA_RUNTIME_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    ingest
        .append(slack_message(&["ada"], "D1", "1700000001.000100", "", "U1", "can you check the deploy?"))
        .await
        .expect("dm");
    claim_and_start(&mut wakes, "ada", "w1", 0).await;
    ingest.append(slack_message(&["ada"], "D1", "1700000002.000100", "", "U1", "it is red now")).await.expect("dm");
    let held = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("send").into_inner();
    assert!(matches!(held.verdict, Some(api::send_response::Verdict::Held(_))), "{held:?}");
    let allowed = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("resend").into_inner();
    assert!(matches!(allowed.verdict, Some(api::send_response::Verdict::Allowed(_))), "{allowed:?}");
    held.decided_at_seq
}

async fn direct_reads_answer_like_the_api(backend: Backend) {
    let mut server = Server::start(backend);
    let held_seq = incident(&server).await;
    let api_url = format!("http://{}", server.addr);
    let held_seq = held_seq.to_string();
    let commands: [&[&str]; 5] = [
        &["timeline", "--agent", "ada"],
        &["timeline", "--surface", "slack:T1:D1"],
        &["state", "--agent", "ada"],
        &["explain", &held_seq],
        &["export", "--format", "jsonl"],
    ];
    let through_api: Vec<String> = commands
        .iter()
        .map(|command| {
            let mut args = vec!["replay", "--api", &api_url, "--token", REPLAY_TOKEN, "--progress", "off"];
            args.extend_from_slice(command);
            let (ok, stdout, stderr) = Server::run_tool(&args);
            assert!(ok, "replay {command:?} through the API failed: {stderr}");
            assert!(stderr.contains("through the gRPC API"), "says which source it used: {stderr}");
            stdout
        })
        .collect();
    let explanation = &through_api[3];
    assert!(explanation.contains("held"), "explain names the verdict:\n{explanation}");
    assert!(explanation.contains("U1"), "explain names the foreign row's author:\n{explanation}");
    // The verdict is the fold's structure as JSON, not Rust's debug text.
    let verdict = explanation.lines().find_map(|l| l.strip_prefix("verdict: ")).expect("a verdict line");
    let verdict: serde_json::Value = serde_json::from_str(verdict).expect("the verdict line is JSON");
    assert!(verdict["Send"]["Held"].is_object(), "{verdict}");
    assert!(!through_api[2].contains("Subscription {"), "state shows no debug text:\n{}", through_api[2]);
    // Only a running server can compare with its live verdict; the rest must be the same.
    assert!(explanation.contains("live instance's verdict: same"), "{explanation}");
    let through_api: Vec<String> = through_api
        .into_iter()
        .map(|out| {
            out.lines().filter(|l| !l.starts_with("live instance's verdict")).map(|l| format!("{l}\n")).collect()
        })
        .collect();

    server.stop();
    let data = server.data_dir();
    let data = data.to_str().expect("utf-8 path");
    let mut direct = vec!["replay", "--data", data, "--progress", "off"];
    let source = match server.nats_url() {
        Some(url) => {
            direct.extend(["--nats", url]);
            "reading the JetStream stream"
        }
        None => "reading the embedded",
    };
    for (command, api_output) in commands.iter().zip(&through_api) {
        let mut args = direct.clone();
        args.extend_from_slice(command);
        let (ok, stdout, stderr) = Server::run_tool(&args);
        assert!(ok, "replay {command:?} read directly failed: {stderr}");
        assert!(stderr.contains(source), "says which source it used ({source}): {stderr}");
        assert_eq!(&stdout, api_output, "replay {command:?}: the direct read and the API disagree");
    }
    let mut verify = direct.clone();
    verify.push("verify");
    let (ok, stdout, stderr) = Server::run_tool(&verify);
    assert!(ok, "verify of the stopped server's checkpoint failed:\n{stdout}\n{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_on_an_embedded_data_dir_answers_like_the_api() {
    direct_reads_answer_like_the_api(Backend::Embedded).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_on_a_jetstream_stream_answers_like_the_api() {
    direct_reads_answer_like_the_api(Backend::JetStream).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tool_on_a_held_data_dir_reads_through_the_server_holding_it_or_refuses() {
    // Given a server on a random port (not the default one) holding its data dir,
    let server = Server::start(Backend::Embedded);
    incident(&server).await;
    let data = server.data_dir();
    let data = data.to_str().expect("a UTF-8 temp path");
    let export = |source: &[&str]| {
        let mut args = vec!["replay"];
        args.extend_from_slice(source);
        args.extend_from_slice(&["--token", REPLAY_TOKEN, "--progress", "off", "export", "--format", "jsonl"]);
        Server::run_tool(&args)
    };
    let api_url = format!("http://{}", server.addr);
    let (ok, through_api, stderr) = export(&["--api", &api_url]);
    assert!(ok, "{stderr}");
    // when the tool is pointed at the dir, it reads through that server's API and says so;
    let (ok, through_dir, stderr) = export(&["--data", data]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains(&format!("going through its API at {api_url}")), "{stderr}");
    assert_eq!(through_dir, through_api);
    // when the dir does not say where its server listens, the tool refuses with the reason and
    // exports nothing.
    std::fs::remove_file(server.data_dir().join(anima_gateway::server::SERVING_FILE)).expect("remove the record");
    let (ok, stdout, stderr) = export(&["--data", data]);
    assert!(!ok, "{stdout}");
    assert_eq!(stdout, "");
    assert!(stderr.contains("has not said where it listens") && stderr.contains("--api"), "{stderr}");
}

/// `--json` for scripts: every line of `timeline --json` and the one document of `state`,
/// `explain` and `verify` parse as JSON, with RFC 3339 times beside the nanoseconds and the
/// verdict as a JSON value; read directly, the tool prints the same documents as the API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_output_parses_and_carries_rfc3339_times() {
    let mut server = Server::start(Backend::Embedded);
    let held = incident(&server).await;
    let held_seq = held.to_string();
    let api_url = format!("http://{}", server.addr);
    let through_api = |command: &[&str]| {
        let mut args = vec!["replay", "--api", &api_url, "--token", REPLAY_TOKEN, "--progress", "off", "--json"];
        args.extend_from_slice(command);
        let (ok, stdout, stderr) = Server::run_tool(&args);
        assert!(ok, "replay {command:?} --json failed: {stderr}");
        stdout
    };
    let rfc3339 = |value: &serde_json::Value| {
        let text = value.as_str().unwrap_or_else(|| panic!("a time string, not {value}"));
        // 2023-11-14T22:13:20.500Z: what `--from` and `--at` read back.
        assert!(text.len() == 24 && text.ends_with('Z') && &text[10..11] == "T", "{text}");
    };

    let timeline = through_api(&["timeline", "--agent", "ada"]);
    let events: Vec<serde_json::Value> =
        timeline.lines().map(|line| serde_json::from_str(line).expect("each timeline line is JSON")).collect();
    assert!(events.len() >= 5, "{timeline}");
    for event in &events {
        assert!(event["seq"].is_u64() && event["log_time_ns"].is_i64(), "{event}");
        rfc3339(&event["log_time"]);
        assert!(event["subject"].as_str().is_some_and(|s| s.starts_with("anima.v1.")), "{event}");
    }
    let held = events.iter().find(|e| e["seq"].as_u64() == Some(held)).expect("the held send is in the timeline");
    assert_eq!(held["event_type"], "send");
    assert_eq!(held["outcome"]["kind"], "send_held");
    assert!(held["verdict"]["Send"]["Held"].is_object(), "{held}");

    let state: serde_json::Value =
        serde_json::from_str(&through_api(&["state", "--agent", "ada"])).expect("state is one JSON document");
    assert_eq!(state["agent"]["agent_id"], "ada");
    assert_eq!(state["agent"]["registered"], true);
    rfc3339(&state["as_of_log_time"]);
    assert!(state["agent"]["cursors"].as_array().is_some_and(|c| !c.is_empty()), "{state}");

    let explanation: serde_json::Value =
        serde_json::from_str(&through_api(&["explain", &held_seq])).expect("explain is one JSON document");
    assert_eq!(explanation["outcome"]["kind"], "send_held");
    assert!(explanation["verdict"]["Send"]["Held"].is_object(), "{explanation}");
    rfc3339(&explanation["log_time"]);
    for row in explanation["rows_after_cursor"].as_array().expect("rows after the cursor") {
        rfc3339(&row["log_time"]);
    }
    let text = explanation.to_string();
    assert!(!text.contains("Some(") && !text.contains(" { "), "no Rust debug text: {text}");

    server.stop();
    let data = server.data_dir();
    let data = data.to_str().expect("utf-8 path");
    let (ok, direct_state, stderr) =
        Server::run_tool(&["replay", "--data", data, "--progress", "off", "state", "--agent", "ada", "--json"]);
    assert!(ok, "{stderr}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&direct_state).expect("JSON"), state);
    let (ok, verify, stderr) = Server::run_tool(&["replay", "--data", data, "--progress", "off", "--json", "verify"]);
    assert!(ok, "{stderr}");
    let verify: serde_json::Value = serde_json::from_str(&verify).expect("verify is one JSON document");
    assert_eq!(verify["passed"], true, "{verify}");
    assert!(verify["applied_seq"].as_u64().is_some_and(|seq| seq >= 5), "{verify}");
    assert_eq!(verify["first_difference"], serde_json::Value::Null);
}

/// Two deployments on one NATS server: each has its own stream and subject prefix, serves its
/// own events, and the replay tool reads either stream by its name alone. A third with the first
/// one's prefix is refused at start-up, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_share_a_nats_server_under_their_own_prefixes() {
    let first = Server::start(Backend::JetStream);
    let nats = first.nats_url().expect("a NATS server").to_owned();
    let acme = |stream: &str, prefix: &str| ServerOptions {
        args: ["--nats", &nats, "--stream", stream, "--subject-prefix", prefix].map(Into::into).to_vec(),
        ..ServerOptions::default()
    };
    let second = Server::start_with(acme("ACME", "acme.anima"));
    incident(&first).await;
    let mut ingest = second.ingest(CONNECTOR_TOKEN).await;
    ingest.append(slack_message(&["bob"], "D2", "1700000009.000100", "", "U2", "hello bob")).await.expect("dm");

    let export = |stream: &str| {
        let (ok, stdout, stderr) =
            Server::run_tool(&["replay", "--nats", &nats, "--stream", stream, "--progress", "off", "export"]);
        assert!(ok, "export of {stream}: {stderr}");
        stdout.lines().map(|line| serde_json::from_str(line).expect("JSON line")).collect::<Vec<serde_json::Value>>()
    };
    let first_events = export("ANIMA");
    let second_events = export("ACME");
    assert!(first_events.iter().all(|e| e["subject"].as_str().is_some_and(|s| s.starts_with("anima.v1."))));
    assert!(second_events.iter().all(|e| e["subject"].as_str().is_some_and(|s| s.starts_with("acme.anima."))));
    let subjects: Vec<&str> = second_events.iter().filter_map(|e| e["subject"].as_str()).collect();
    assert!(subjects.contains(&"acme.anima.surface.slack.T1.D2"), "{subjects:?}");
    assert!(
        !first_events.iter().any(|e| e.to_string().contains("hello bob")),
        "the first stream has its own events only"
    );
    assert!(second_events.iter().any(|e| e.to_string().contains("hello bob")));
    assert!(!second_events.iter().any(|e| e.to_string().contains("deploy")), "the second stream has its own only");

    let stderr = serve_refused(
        &std::fs::read_to_string(second.data_dir().join("../anima.toml")).expect("the fixture's config"),
        &["--nats", &nats, "--stream", "OTHER", "--listen", "127.0.0.1:0"],
    );
    assert!(stderr.contains("overlap") && stderr.contains("subject prefix"), "{stderr}");
}

/// `store-stats`: refused while the server holds its data dir (it names the dir as in use);
/// once the server stopped, it prints the dir's size on disk against what it holds, with the
/// log tree and the checkpoint tree broken down by table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_stats_counts_a_stopped_servers_data_dir() {
    let mut server = Server::start(Backend::Embedded);
    incident(&server).await;
    let data = server.data_dir();
    let data = data.to_str().expect("a UTF-8 temp path");
    let (ok, stdout, stderr) = Server::run_tool(&["store-stats", "--data", data]);
    assert!(!ok, "{stdout}");
    assert!(stderr.contains("is in use"), "{stderr}");
    server.stop();
    let (ok, stdout, stderr) = Server::run_tool(&["store-stats", "--data", data]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with(&format!("data dir {data}: ")) && stdout.contains("% live)"), "{stdout}");
    assert!(stdout.contains("tree log: "), "{stdout}");
    let checkpoint = stdout.split("tree checkpoint-embedded: ").nth(1).expect("the checkpoint tree");
    for table in ["journal_rows (pages)", "identities", "cursors", "checkpoint metadata"] {
        assert!(checkpoint.contains(table), "{table} in:\n{stdout}");
    }
    let (ok, _, stderr) = Server::run_tool(&["store-stats", "--data", &format!("{data}-missing")]);
    assert!(!ok && stderr.contains("no data dir at"), "{stderr}");
}

/// The replay tool's `command` through the server's API: its output.
fn replay_through_api(server: &Server, command: &[&str]) -> String {
    let api_url = format!("http://{}", server.addr);
    let mut args = vec!["replay", "--api", &api_url, "--token", REPLAY_TOKEN, "--progress", "off"];
    args.extend_from_slice(command);
    let (ok, stdout, stderr) = Server::run_tool(&args);
    assert!(ok, "replay {command:?} through the API failed: {stderr}");
    stdout
}

/// `compact`: refused while the server holds its data dir; once it stopped, it copies the dir
/// into a new one that the server restarts on with the same state (the replay tool's `state`
/// and `timeline` read the same through the API), and the server goes on deciding on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_copies_a_stopped_servers_data_dir_and_the_server_runs_on_the_copy() {
    let mut server = Server::start(Backend::Embedded);
    incident(&server).await;
    let views = [&["state", "--agent", "ada"][..], &["timeline", "--surface", "slack:T1:D1"][..]];
    let before: Vec<String> = views.iter().map(|command| replay_through_api(&server, command)).collect();
    let data = server.data_dir();
    let copy = data.with_file_name("data-compact");
    let (data_arg, copy_arg) = (data.to_str().expect("a UTF-8 temp path"), copy.to_str().expect("UTF-8"));
    let (ok, stdout, stderr) = Server::run_tool(&["compact", "--data", data_arg, "--into", copy_arg]);
    assert!(!ok && stderr.contains("is in use"), "{stdout}{stderr}");
    assert!(!copy.exists(), "a refused compaction writes nothing");
    server.stop();
    let (ok, stdout, stderr) = Server::run_tool(&["compact", "--data", data_arg, "--into", copy_arg]);
    assert!(ok, "{stderr}");
    assert!(stdout.starts_with(&format!("compacted {data_arg} (")) && stdout.contains("checked"), "{stdout}");
    assert!(stderr.contains("compact: tree log: "), "progress names the trees: {stderr}");
    let (ok, _, stderr) = Server::run_tool(&["compact", "--data", data_arg, "--into", copy_arg]);
    assert!(!ok && stderr.contains("already exists"), "{stderr}");
    // The server starts on the copy (moved where its data dir was): same state, same answers.
    std::fs::rename(&data, data.with_file_name("data-before")).expect("move the old dir away");
    std::fs::rename(&copy, &data).expect("the copy takes its place");
    server.restart();
    let after: Vec<String> = views.iter().map(|command| replay_through_api(&server, command)).collect();
    assert_eq!(after, before, "the copy holds the same log and state");
    let mut ingest = server.ingest(CONNECTOR_TOKEN).await;
    let mut sends = server.sends(ADA_RUNTIME_TOKEN).await;
    ingest.append(slack_message(&["ada"], "D1", "1700000003.000100", "", "U1", "still red")).await.expect("dm");
    let held = sends.send(send_request("ada", slack_target("D1", ""))).await.expect("send").into_inner();
    assert!(matches!(held.verdict, Some(api::send_response::Verdict::Held(_))), "the new DM holds: {held:?}");
}
