//! The send hold across cluster failovers: two `anima-wake` processes on an R3 stream of a 3-node
//! JetStream cluster, both given the whole server list. Writers append foreign messages into a
//! DM and senders send into it through both instances, retrying UNAVAILABLE with the same ids as
//! a connector and a runtime do, while the stream leader is killed (SIGKILL) twice. Afterwards
//! the race checker of `race` reads the raw log: no send may have been allowed over a foreign
//! row, and every acknowledged append and every answered send is stored exactly once.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anima_engine::testing::{poll_until, stream_view, NatsCluster};
use anima_gateway::api;
use tokio::time::Instant;

use crate::fixture::*;
use crate::race::{audit_send_hold, start_ada_dm_wake, RACE_DM};

/// The stream the engines create (their default name).
const STREAM: &str = "ANIMA";
/// Leader kills, each followed by the killed node's restart.
const KILLS: usize = 2;
/// Writers of foreign messages; writer `w` goes through instance `w % 2`.
const WRITERS: usize = 2;
/// Senders; each alternates between the two instances from one send to the next.
const SENDERS: usize = 4;
/// Requests answered before the first kill, between the recovery of one kill and the next,
/// and after the last: every phase has traffic.
const ANSWERS_PER_PHASE: usize = 150;
/// Requests one worker makes at most: the bound on the test's traffic if a phase never ends.
const REQUESTS_PER_WORKER_MAX: usize = 20_000;
/// Pause between two requests of one worker. Without it six workers keep two cores busy and
/// every figure measures the machine's load rather than the failover.
const REQUEST_PAUSE: Duration = Duration::from_millis(10);
/// Pause before retrying a request answered UNAVAILABLE (a runtime's retry pace).
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Bound on every wait: one request retried until answered, the cluster forming, an election,
/// a node catching up. Each is seconds when things work; the bound turns a hang into a failure.
const STEP_DEADLINE: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Append,
    Send,
}

/// One request a worker got an answer for.
#[derive(Debug)]
struct Answer {
    instance: usize,
    kind: Kind,
    /// The request's id: the Slack ts of an append, the request id of a send.
    id: String,
    /// Where the request sits in the log, as the answer said.
    seq: u64,
    /// For a send: whether it was allowed.
    allowed: bool,
    at: Instant,
}

/// What every worker shares with the test.
#[derive(Default)]
struct Progress {
    answered: AtomicUsize,
    /// The newest seq answered through each instance.
    newest_seq: [AtomicU64; 2],
    stop: AtomicBool,
    /// UNAVAILABLE answers that were retried.
    retries: AtomicUsize,
}

impl Progress {
    fn answered(&self, answer: &Answer) {
        self.newest_seq[answer.instance].fetch_max(answer.seq, Ordering::Relaxed);
        self.answered.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until `more` requests were answered after `since` (a count read before).
    async fn wait_answered(&self, since: usize, more: usize, what: &str) {
        poll_until(what, || async { (self.answered.load(Ordering::Relaxed) >= since + more).then_some(()) }).await;
    }
}

/// Calls `call` until it answers, retrying UNAVAILABLE (the engine says: try again) with the
/// same request; any other refusal fails the test.
async fn until_answered<T, F, Fut>(what: &str, progress: &Progress, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = Instant::now() + STEP_DEADLINE;
    loop {
        match call().await {
            Ok(response) => return response.into_inner(),
            Err(status) if status.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                progress.retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(RETRY_PAUSE).await;
            }
            Err(status) => panic!("{what}: {status:?}"),
        }
    }
}

/// One leader kill as the test saw it.
struct Kill {
    leader: String,
    new_leader: String,
    /// The stream's last seq as the new leader first reported it: nothing after it was stored
    /// before the election.
    seq_at_election: u64,
    killed_at: Instant,
    elected_at: Instant,
    /// When stream info first showed an event stored after the election.
    log_grew_at: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_send_is_allowed_over_a_foreign_message_across_stream_leader_kills() {
    let test_started = Instant::now();
    // JetStream places replicated streams only once it has elected its meta leader and knows
    // every peer; until then an engine cannot create its stream and refuses to start.
    let mut cluster = NatsCluster::start_placing().await;
    let admin = cluster.admin().await;

    // Both engines get the whole server list; the first creates the stream with 3 replicas.
    let options = ServerOptions { args: vec!["--replicas".into(), "3".into()], ..ServerOptions::default() };
    let first = Server::start_on_nats_with(&cluster.urls(), options.clone());
    let second = Server::start_on_nats_with(&cluster.urls(), options);
    let view = poll_until("the stream has a leader and current followers", || async {
        stream_view(&admin, STREAM).await.filter(|view| view.followers_current)
    })
    .await;
    assert_eq!(view.replicas, 3, "--replicas 3 created an R3 stream");
    let started_at_seq = start_ada_dm_wake(&first).await;

    let progress = Arc::new(Progress::default());
    let instances = [&first, &second];
    let mut workers = Vec::new();
    for writer in 0..WRITERS {
        let instance = writer % 2;
        let ingest = instances[instance].ingest(CONNECTOR_TOKEN).await;
        let progress = progress.clone();
        workers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..REQUESTS_PER_WORKER_MAX {
                if progress.stop.load(Ordering::Relaxed) {
                    break;
                }
                // The same ts on every attempt: the engine derives the event id from it.
                let ts = format!("17{writer:02}{n:06}.000100");
                let request = slack_message(&["ada"], RACE_DM, &ts, "", "U7", "news");
                let response = until_answered("append", &progress, || {
                    let (mut ingest, request) = (ingest.clone(), request.clone());
                    async move { ingest.append(request).await }
                })
                .await;
                let seq = response.outcomes.first().expect("one outcome for ada").seq;
                let answer = Answer { instance, kind: Kind::Append, id: ts, seq, allowed: false, at: Instant::now() };
                progress.answered(&answer);
                answers.push(answer);
                tokio::time::sleep(REQUEST_PAUSE).await;
            }
            answers
        }));
    }
    for sender in 0..SENDERS {
        let clients = [first.sends(ADA_RUNTIME_TOKEN).await, second.sends(ADA_RUNTIME_TOKEN).await];
        let progress = progress.clone();
        workers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..REQUESTS_PER_WORKER_MAX {
                if progress.stop.load(Ordering::Relaxed) {
                    break;
                }
                let instance = (sender + n) % 2;
                // A runtime's request id, kept across retries, so a send stored before its
                // answer was lost is not stored twice.
                let request_id = format!("{sender:08x}-0000-4000-8000-{n:012x}");
                let request = api::SendRequest {
                    request_id: request_id.clone(),
                    ..send_request("ada", slack_target(RACE_DM, ""))
                };
                let response = until_answered("send", &progress, || {
                    let (mut client, request) = (clients[instance].clone(), request.clone());
                    async move { client.send(request).await }
                })
                .await;
                let allowed = matches!(response.verdict, Some(api::send_response::Verdict::Allowed(_)));
                let answer = Answer {
                    instance,
                    kind: Kind::Send,
                    id: request_id,
                    seq: response.decided_at_seq,
                    allowed,
                    at: Instant::now(),
                };
                progress.answered(&answer);
                answers.push(answer);
                tokio::time::sleep(REQUEST_PAUSE).await;
            }
            answers
        }));
    }

    let mut kills = Vec::new();
    for _ in 0..KILLS {
        let answered = progress.answered.load(Ordering::Relaxed);
        progress.wait_answered(answered, ANSWERS_PER_PHASE, "traffic before the kill").await;
        let leader = poll_until("the stream leader is known", || stream_view(&admin, STREAM)).await.leader;
        let node = cluster.node_named(&leader).unwrap_or_else(|| panic!("leader {leader:?} is not a node"));
        tokio::task::block_in_place(|| cluster.node(node).kill());
        let killed_at = Instant::now();
        let elected = poll_until("a new stream leader is elected", || async {
            stream_view(&admin, STREAM).await.filter(|view| view.leader != leader)
        })
        .await;
        let elected_at = Instant::now();
        let seq_at_election = elected.last_seq;
        poll_until("the log stores events again", || async {
            stream_view(&admin, STREAM).await.filter(|view| view.last_seq > seq_at_election)
        })
        .await;
        let log_grew_at = Instant::now();
        // Both instances answer requests stored after the election (their folds applied them).
        poll_until("both instances answer again", || async {
            progress.newest_seq.iter().all(|newest| newest.load(Ordering::Relaxed) > seq_at_election).then_some(())
        })
        .await;
        tokio::task::block_in_place(|| cluster.node(node).resume());
        poll_until("the restarted node catches up", || async {
            stream_view(&admin, STREAM).await.filter(|view| view.followers_current)
        })
        .await;
        kills.push(Kill { leader, new_leader: elected.leader, seq_at_election, killed_at, elected_at, log_grew_at });
    }
    let answered = progress.answered.load(Ordering::Relaxed);
    progress.wait_answered(answered, ANSWERS_PER_PHASE, "traffic after the last kill").await;
    progress.stop.store(true, Ordering::Relaxed);
    let mut answers = Vec::new();
    for worker in workers {
        answers.extend(tokio::time::timeout(STEP_DEADLINE, worker).await.expect("a worker stops").expect("worker"));
    }

    // The clients' view: seq → verdict of every send answered, and each id with its seq.
    let mut verdicts = BTreeMap::new();
    let mut acknowledged: BTreeMap<(Kind, &str), u64> = BTreeMap::new();
    for answer in &answers {
        if answer.kind == Kind::Send {
            let earlier = verdicts.insert(answer.seq, answer.allowed);
            assert!(earlier.is_none(), "two sends answered at seq {}", answer.seq);
        }
        let earlier = acknowledged.insert((answer.kind, answer.id.as_str()), answer.seq);
        assert!(earlier.is_none(), "{} answered twice", answer.id);
    }
    let sends = verdicts.len();
    let allowed = verdicts.values().filter(|allowed| **allowed).count();
    let appends = answers.len() - sends;

    let audit = audit_send_hold(&cluster.urls(), started_at_seq, &verdicts).await;
    let stored_once = |kind: Kind, seqs: &BTreeMap<String, Vec<u64>>| {
        let lost = acknowledged
            .iter()
            .filter(|((k, id), seq)| *k == kind && seqs.get(*id).is_none_or(|stored| !stored.contains(seq)))
            .count();
        let duplicated = seqs.values().filter(|stored| stored.len() > 1).count();
        (lost, duplicated)
    };
    let (appends_lost, appends_duplicated) = stored_once(Kind::Append, &audit.message_seqs);
    let (sends_lost, sends_duplicated) = stored_once(Kind::Send, &audit.send_seqs);

    eprintln!(
        "cluster send hold: {appends} appends and {sends} sends ({allowed} allowed) answered through 2 instances, \
         {} UNAVAILABLE answers retried, {} kills of the stream leader; lost {appends_lost} appends and \
         {sends_lost} sends, duplicated {appends_duplicated} appends and {sends_duplicated} sends; {} sends checked, \
         {} unsafe; {:.1} s in all",
        progress.retries.load(Ordering::Relaxed),
        kills.len(),
        audit.checked,
        audit.unsafe_sends.len(),
        test_started.elapsed().as_secs_f64()
    );
    // A request counts as served again after a kill once one is answered that the log stored
    // after the election (nothing can be stored between the kill and the election).
    for (number, kill) in kills.iter().enumerate() {
        let since_kill = |at: Instant| format!("{:.2} s", (at - kill.killed_at).as_secs_f64());
        let first_after = |instance: usize, kind: Option<Kind>| {
            answers
                .iter()
                .filter(|a| a.instance == instance && kind.is_none_or(|k| a.kind == k) && a.seq > kill.seq_at_election)
                .map(|a| a.at)
                .min()
                .expect("both instances answered after every election")
        };
        eprintln!(
            "  kill {} of leader {}: new leader {} after {}, the log stored again after {}",
            number + 1,
            kill.leader,
            kill.new_leader,
            since_kill(kill.elected_at),
            since_kill(kill.log_grew_at),
        );
        for (instance, name) in ["first", "second"].iter().enumerate() {
            let served = first_after(instance, None);
            eprintln!(
                "    {name} instance: appends unavailable {}, sends {}; its fold applied an event stored after the \
                 election {:.2} s after it ({:.2} s after the log stored again)",
                since_kill(first_after(instance, Some(Kind::Append))),
                since_kill(first_after(instance, Some(Kind::Send))),
                served.saturating_duration_since(kill.elected_at).as_secs_f64(),
                served.saturating_duration_since(kill.log_grew_at).as_secs_f64(),
            );
        }
    }

    assert_eq!(kills.len(), KILLS);
    assert_eq!(audit.unsafe_sends, Vec::<u64>::new(), "sends allowed over a foreign row");
    assert_eq!(audit.needlessly_held, Vec::<u64>::new(), "sends held although the log shows no foreign row");
    assert_eq!(audit.unanswered, Vec::<u64>::new(), "every send in the log was answered");
    assert_eq!(audit.checked, sends, "every answered send was checked");
    assert!(allowed > 0 && allowed < sends, "both verdicts occur ({allowed} of {sends} allowed)");
    assert_eq!(
        (appends_lost, sends_lost),
        (0, 0),
        "every acknowledged append and send is stored where its answer said"
    );
    assert_eq!((appends_duplicated, sends_duplicated), (0, 0), "nothing is stored twice");
    // The DM holds the first message and the acknowledged ones, nothing else.
    assert_eq!(audit.message_seqs.len(), appends + 1);
    assert_eq!(audit.send_seqs.len(), sends);
}
