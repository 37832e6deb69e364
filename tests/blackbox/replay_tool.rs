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
