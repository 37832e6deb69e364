//! A deterministic simulation of the whole engine (issue 11, "What to build" 3).
//!
//! One process, the embedded sled log in a temp dir, a manual clock, no sleeps: a seeded list of
//! steps interleaves Slack, chat and Linear ingest, claims, starts, finishes, heartbeats, sends,
//! confirms, mutes, memory-pass ticks and recovery ticks over simulated days and weeks, with
//! injected crashes (an instance's runner killed without its last checkpoint and restarted from
//! the data dir; the whole process dropped and reopened; a send whose append landed just before
//! the crash, retried afterwards with the same request id), on one or two engine instances that
//! share the log. The step list depends only on the seed; what a step does depends on what the
//! engine answered, the same way every time.
//!
//! After every step an independent checker reads every new event back from the raw log, decodes
//! it, and replays it through its own model (journals, cursors, queues, settles, open passes)
//! together with the verdict the fold recorded. The model is written from the design rules, not from the
//! fold's code: it knows who owns a row, which rows a cursor passed and what is queued, and checks
//! * no send is allowed over a foreign row before it in the log that its cursor had not passed,
//!   and no send is held without one;
//! * a start is accepted only with the cursors its plan expected, and moves them to its targets;
//! * every queued item settles at most once, and a settled item never comes back;
//! * `maxConcurrent` is never exceeded and an agent gets at most one pass per window-day;
//! * both instances record the same verdict for every event, and each engine's queues equal the
//!   model's after every step;
//! * no running wake outlives its heartbeat window past a recovery tick;
//! * an instance restarted from its checkpoint equals a rebuild of the raw log, byte for byte.
//!
//! At the end of each seed a rebuild from the raw log equals the live state of every instance
//! byte for byte, and `Replayer::explain` of every send agrees with the verdict the client got.
//!
//! Rules that were once broken (a claim nobody starts stayed forever; the heartbeat rate limit
//! read the wall clock; the held notice counted the agent's own rows; a memory pass could post)
//! fail a seed by default; `ANIMA_SIM_STRICT=0` or a list only counts them (see [`Strict`]).
//!
//! `ANIMA_SIM_SEEDS=N` runs N seeds (default [`SEEDS_DEFAULT`]), `ANIMA_SIM_SEED=S` runs one,
//! `ANIMA_SIM_STEPS=K` sets the steps per seed, `ANIMA_SIM_PARALLEL=P` runs P seeds at once,
//! `ANIMA_SIM_TORN=1` tears checkpoints (see [`Step::TornCheckpoint`]). A failure prints the
//! seed, the scenario shrunk to the fewest steps that still fail the same way, and the command
//! that reruns it.
//!
//! The instances are built from their parts (sled, the embedded log, a runner, an engine) rather
//! than with `Instance::start`, whose recovery loop ticks once at start-up on its own task: an
//! append the step list does not order. Recovery and memory ticks are steps here instead.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anima_engine::checkpoint::{CheckpointDb, CheckpointStore};
use anima_engine::clock::{Clock, ManualClock};
use anima_engine::command::{ChatObservation, CommandError, LinearObservation, SlackObservation};
use anima_engine::log::embedded::{EmbeddedConfig, EmbeddedLog};
use anima_engine::log::{AppendRecord, EventLog};
use anima_engine::replay::{ReplayConfig, Replayer};
use anima_engine::{Engine, EngineConfig, Runner, RunnerConfig};
use anima_projections::memory::MemoryConfig;
use anima_projections::proto::{self, envelope::Payload};
use anima_projections::surface::SurfaceId;
use anima_projections::verdict::{ClaimVerdict, RefusalKind, SendVerdict, Verdict};
use anima_projections::wake::PlanEntry;
use bytes::Bytes;
use futures::StreamExt;
use prost::Message;
use tokio_util::sync::CancellationToken;

/// Seeds of the default run (`cargo test`).
const SEEDS_DEFAULT: u64 = 1_000;
/// Seeds run at once (`ANIMA_SIM_PARALLEL`). One by default: on 2 loaded cores, 4 at once took
/// twice as long as 1 (each sled database brings its own threads).
const SEEDS_IN_FLIGHT_DEFAULT: usize = 1;
/// Steps of one seed in the default run: small seeds, many of them.
const STEPS_DEFAULT: usize = 40;
/// How long a step waits for an instance to apply what the log holds.
const APPLY_WAIT: Duration = Duration::from_secs(20);
/// How long a reopen waits for sled's directory lock, which its flusher thread releases a moment
/// after the last handle drops.
const LOCK_WAIT: Duration = Duration::from_secs(10);
/// Reopens that found sled's lock still held, for the summary line.
static LOCK_RETRIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The checkpoint key of the fold's meta entry (applied seq): the state prefix, then table 0.
const META_ENTRY_KEY: [u8; 2] = [anima_engine::checkpoint::STATE_PREFIX, 0];
/// A stored meta entry (its bytes).
type MetaEntry = Vec<u8>;

const MINUTE_NS: i64 = 60 * 1_000_000_000;
const DAY_NS: i64 = 24 * 60 * MINUTE_NS;
/// A running wake silent this long (log time) may be re-queued.
const HEARTBEAT_SILENCE_NS: i64 = 30 * MINUTE_NS;
/// An id settled this recently is a duplicate.
const SETTLED_REMEMBERED_NS: i64 = 14 * DAY_NS;
/// The claim lease's default; a claim abandoned longer than this plus a recovery
/// tick is a stuck agent.
const CLAIM_LEASE_NS: i64 = 5 * MINUTE_NS;
/// The engine appends at most one heartbeat per item this often.
const HEARTBEAT_INTERVAL_NS: i64 = MINUTE_NS;

const TEAM: &str = "T1";
const TENANT: &str = "t1";
const INSTALLATION: &str = "inst1";
const AGENTS: [&str; 3] = ["ada", "bo", "cy"];
const HUMANS: [&str; 2] = ["UHUMAN1", "UHUMAN2"];
const CHAT_HUMANS: [&str; 2] = ["h1", "h2"];
const CHANNELS: [&str; 2] = ["C1", "C2"];
const GROUP_CHAT: &str = "g1";

fn bot_user_id(agent: usize) -> String {
    format!("UBOT{agent}")
}
fn bot_id(agent: usize) -> String {
    format!("B{agent}")
}
fn chat_user_id(agent: usize) -> String {
    format!("cu{agent}")
}
fn dm_channel(agent: usize) -> String {
    format!("D{agent}")
}
fn p2p_chat(agent: usize) -> String {
    format!("p{agent}")
}

// ---------------------------------------------------------------------------------------------
// Seeded randomness (SplitMix64: tiny, no dependency, the same on every platform).

// Every case is a function of the seed.
use anima_engine::testing::SeededRng as Rng;

// ---------------------------------------------------------------------------------------------
// Steps: plain data, a pure function of the seed, so any prefix can be rerun.

#[derive(Clone, Debug)]
enum Author {
    Human(usize),
    Agent(usize),
}

#[derive(Clone, Debug)]
enum Step {
    /// A Slack message: in a DM (`channel: None`, to `dm_of`) or a channel, at the top level or
    /// in the thread of the `thread`-th newest top-level message there.
    Slack {
        channel: Option<usize>,
        dm_of: usize,
        thread: Option<usize>,
        author: Author,
        mention: Option<usize>,
    },
    /// A connector retry of the `back`-th newest Slack delivery (same ids).
    Redeliver {
        back: usize,
    },
    /// A chat message in the group chat or an agent's p2p chat, at the top level or in the
    /// thread of the `thread`-th newest top-level message there.
    Chat {
        p2p_of: Option<usize>,
        thread: Option<usize>,
        author: Author,
        mention: Option<usize>,
    },
    LinearCreated {
        agent: usize,
    },
    /// A new prompt in the `back`-th newest Linear session.
    LinearPrompted {
        back: usize,
    },
    /// A stop of the `back`-th newest Linear session: its queued input goes.
    LinearStop {
        back: usize,
    },
    Claim {
        agent: usize,
        node: usize,
    },
    Start {
        agent: usize,
        node: usize,
    },
    /// 0 completed, 1 failed, 2 aborted, 3 restart drain.
    Finish {
        agent: usize,
        node: usize,
        outcome: u8,
    },
    Heartbeat {
        agent: usize,
        node: usize,
    },
    /// To the running wake's reply target, or (`anywhere`) to one of the agent's surfaces.
    Send {
        agent: usize,
        node: usize,
        anywhere: Option<usize>,
        confirm: bool,
    },
    Mute {
        agent: usize,
        node: usize,
        surface: usize,
        mute: bool,
    },
    /// The runtime forgets its claim or run: nobody will start or finish it.
    WorkerDies {
        agent: usize,
    },
    Advance {
        minutes: i64,
    },
    Recover {
        node: usize,
    },
    MemoryTick {
        node: usize,
    },
    /// One instance's runner dies without its last checkpoint and restarts from the data dir.
    CrashNode {
        node: usize,
    },
    /// The whole process dies (every instance, the log) and restarts from the data dir.
    CrashAll,
    /// A person's channel message reaches every agent; the process dies after the first
    /// receiver's event landed; the connector retries the whole observation (same ids).
    CrashDuringIngest {
        channel: usize,
    },
    /// Opt-in (`ANIMA_SIM_TORN=1`): a node dies and its checkpoint is torn between its items and
    /// its meta entry: the items of the newest checkpoint with the meta entry (applied seq) of
    /// the one before. The checkpoint's redo record makes this unreachable through the engine.
    TornCheckpoint {
        node: usize,
    },
    /// A send's append lands, the process dies before the verdict, the runtime retries the same
    /// request id after the restart.
    CrashDuringSend {
        agent: usize,
    },
}

/// What varies per seed besides the steps.
#[derive(Clone, Debug)]
struct Scenario {
    nodes: usize,
    max_concurrent: i64,
    checkpoint_every_events: u64,
    start_ns: i64,
    steps: Vec<Step>,
}

fn scenario(seed: u64, steps: usize) -> Scenario {
    let torn = std::env::var("ANIMA_SIM_TORN").is_ok_and(|v| v == "1");
    let mut rng = Rng(seed ^ 0xA5A5_5A5A_0F0F_F0F0);
    let nodes = 1 + rng.index(2);
    let max_concurrent = 1 + rng.below(2) as i64;
    let checkpoint_every_events = 1 + rng.below(12);
    // 2026-03-02T00:00Z plus up to a day.
    let start_ns = 1_772_409_600 * 1_000_000_000 + rng.below(24 * 60) as i64 * MINUTE_NS;
    let list = (0..steps)
        .map(|_| match step(&mut rng, nodes) {
            Step::CrashNode { node } if torn => Step::TornCheckpoint { node },
            other => other,
        })
        .collect();
    Scenario { nodes, max_concurrent, checkpoint_every_events, start_ns, steps: list }
}

fn step(rng: &mut Rng, nodes: usize) -> Step {
    let agent = rng.index(AGENTS.len());
    let node = rng.index(nodes);
    let author = |rng: &mut Rng| {
        if rng.percent(75) {
            Author::Human(rng.index(HUMANS.len()))
        } else {
            Author::Agent(rng.index(AGENTS.len()))
        }
    };
    match rng.below(100) {
        0..=11 => Step::Slack { channel: None, dm_of: agent, thread: None, author: author(rng), mention: None },
        12..=23 => Step::Slack {
            channel: Some(rng.index(CHANNELS.len())),
            dm_of: agent,
            thread: rng.percent(50).then(|| rng.index(3)),
            author: author(rng),
            mention: rng.percent(30).then(|| rng.index(AGENTS.len())),
        },
        24..=25 => Step::Redeliver { back: rng.index(4) },
        26..=30 => Step::Chat {
            p2p_of: rng.percent(40).then_some(agent),
            thread: rng.percent(30).then(|| rng.index(3)),
            author: author(rng),
            mention: rng.percent(30).then(|| rng.index(AGENTS.len())),
        },
        31 => Step::LinearCreated { agent },
        32 => match rng.below(3) {
            0 => Step::LinearCreated { agent },
            1 => Step::LinearPrompted { back: rng.index(3) },
            _ => Step::LinearStop { back: rng.index(3) },
        },
        33..=46 => Step::Claim { agent, node },
        47..=58 => Step::Start { agent, node },
        59..=65 => Step::Finish { agent, node, outcome: rng.below(4) as u8 },
        66..=68 => Step::Heartbeat { agent, node },
        69..=80 => {
            Step::Send { agent, node, anywhere: rng.percent(35).then(|| rng.index(64)), confirm: rng.percent(60) }
        }
        81..=82 => Step::Mute { agent, node, surface: rng.index(64), mute: rng.percent(70) },
        83 => Step::WorkerDies { agent },
        84..=90 => Step::Advance {
            minutes: match rng.below(10) {
                0..=5 => 1 + rng.below(20) as i64,
                6..=8 => 30 + rng.below(600) as i64,
                _ => 24 * 60 + rng.below(3 * 24 * 60) as i64,
            },
        },
        91..=92 => Step::Recover { node },
        93..=94 => Step::MemoryTick { node },
        95..=96 => Step::CrashNode { node },
        97 => Step::CrashAll,
        98 => Step::CrashDuringSend { agent },
        _ => Step::CrashDuringIngest { channel: rng.index(CHANNELS.len()) },
    }
}

// ---------------------------------------------------------------------------------------------
// The world outside the engine: the data dir, the instances, the runtime's own view.

struct Node {
    engine: Engine,
    runner: tokio::task::JoinHandle<Result<(), anima_engine::projection::RunnerError>>,
    shutdown: CancellationToken,
}

/// What the simulated runtime holds for one agent: a claimed (maybe started) wake.
#[derive(Clone, Debug)]
struct Held {
    item_id: String,
    worker: String,
    plan: Vec<proto::PlanSurface>,
    reply_to: SurfaceId,
    started: bool,
    memory: bool,
    /// Sim time of the runtime's last heartbeat call (or of the claim/start).
    last_heartbeat_call_ns: i64,
}

/// A Slack delivery as sent, for redeliveries.
#[derive(Clone, Debug)]
struct SlackDelivery {
    observation: SlackObservation,
}

struct Sim {
    scenario: Scenario,
    dir: tempfile::TempDir,
    clock: Arc<ManualClock>,
    log: Option<Arc<dyn EventLog>>,
    /// Each node's own sled database (its checkpoints).
    node_dbs: Vec<Option<CheckpointDb>>,
    nodes: Vec<Option<Node>>,
    held: BTreeMap<usize, Held>,
    workers_started: u64,
    counter: u64,
    /// Top-level Slack ts per channel, newest last (thread roots).
    roots: BTreeMap<String, Vec<String>>,
    deliveries: Vec<SlackDelivery>,
    /// Top-level chat message ids per chat, newest last (thread roots).
    chat_roots: BTreeMap<String, Vec<String>>,
    /// Linear sessions as (agent, session id), newest last.
    sessions: Vec<(usize, String)>,
    /// Surfaces the runtime may post to or mute, as they appeared.
    surfaces: Vec<SurfaceId>,
    /// Per agent: the surfaces of the wakes it was given (plans and reply targets), where it
    /// has cursors; most of its sends "anywhere" go there.
    known: BTreeMap<usize, Vec<SurfaceId>>,
    /// Every send decision the client got: seq → verdict.
    sends: BTreeMap<u64, SendVerdict>,
    model: Model,
    /// Sim time of the last appended heartbeat per (node, agent, item).
    heartbeats_appended: BTreeMap<(usize, String, String), i64>,
    /// Per node: the meta entries of its newest two checkpoints (older, newer).
    checkpoint_metas: BTreeMap<usize, (Option<MetaEntry>, Option<MetaEntry>)>,
    /// The step was a recovery tick: no running wake may outlive its heartbeat window after it.
    recovery_ticked: bool,
    findings: Findings,
}

/// Once-known defects that fail a seed instead of being counted: all of them by default (or
/// `ANIMA_SIM_STRICT=1`), none with `ANIMA_SIM_STRICT=0`, or a comma-separated list of
/// `heartbeat`, `recovery`, `stuck`, `held_count`, `sealed`.
#[derive(Clone, Copy, Debug, Default)]
struct Strict {
    /// A heartbeat dropped by the rate limit although the injected clock says a minute passed
    /// (issue 11, defect 7: the limit reads `Instant::now`).
    heartbeat: bool,
    /// A running wake re-queued although its runtime heartbeated within the silence bound.
    recovery: bool,
    /// A claim abandoned before its start still held a day later (issue 11, defect 1).
    stuck: bool,
    /// A held notice counting the agent's own rows as new messages.
    held_count: bool,
    /// A send allowed while the agent's memory pass runs.
    sealed: bool,
}

impl Strict {
    fn from_env() -> Strict {
        // Every known defect has its fix on main: all of them fail a seed unless
        // `ANIMA_SIM_STRICT=0` (or a list) says otherwise.
        let value = std::env::var("ANIMA_SIM_STRICT").unwrap_or_else(|_| "1".to_owned());
        let all = value.trim() == "1";
        let on = |name: &str| all || value.split(',').any(|v| v.trim() == name);
        Strict {
            heartbeat: on("heartbeat"),
            recovery: on("recovery"),
            stuck: on("stuck"),
            held_count: on("held_count"),
            sealed: on("sealed"),
        }
    }
}

/// Liveness defects and deviations counted, not failed, unless [`Strict`].
#[derive(Clone, Debug, Default)]
struct Findings {
    /// A heartbeat call answered "rate limited" although this instance appended none for the item
    /// within the interval of the injected clock.
    heartbeats_dropped: u64,
    /// A running wake re-queued by recovery although its runtime called Heartbeat within the
    /// silence bound.
    recovered_while_heartbeating: u64,
    /// Agent/item of every abandoned claim still held a day later, after a recovery tick past
    /// its lease.
    stuck_claims: BTreeSet<String>,
    /// Held sends whose notice counted the agent's own rows as new messages.
    held_counts_own_rows: u64,
    /// Sends allowed while the agent's running wake was a memory pass.
    sends_during_memory_pass: u64,
}

type SimResult<T> = Result<T, String>;

fn engine_error(what: &str, e: CommandError) -> String {
    format!("{what}: the engine answered {e:?}")
}

impl Sim {
    async fn open(scenario: Scenario) -> SimResult<Sim> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let clock = Arc::new(ManualClock::new(scenario.start_ns));
        let nodes = (0..scenario.nodes).map(|_| None).collect();
        let node_dbs = (0..scenario.nodes).map(|_| None).collect();
        let mut sim = Sim {
            scenario,
            dir,
            clock,
            log: None,
            node_dbs,
            nodes,
            held: BTreeMap::new(),
            workers_started: 0,
            counter: 0,
            roots: BTreeMap::new(),
            deliveries: Vec::new(),
            chat_roots: BTreeMap::new(),
            sessions: Vec::new(),
            surfaces: Vec::new(),
            known: BTreeMap::new(),
            sends: BTreeMap::new(),
            model: Model::default(),
            heartbeats_appended: BTreeMap::new(),
            checkpoint_metas: BTreeMap::new(),
            recovery_ticked: false,
            findings: Findings::default(),
        };
        sim.start_process().await?;
        let engine = sim.engine(0);
        for (n, agent) in AGENTS.iter().enumerate() {
            let registration = proto::AgentRegistered {
                agent_id: (*agent).to_owned(),
                slack_bot_user_id: bot_user_id(n),
                slack_bot_id: bot_id(n),
                display_name: format!("Agent {agent}"),
                chat_user_id: chat_user_id(n),
            };
            engine.register_agent(registration).await.map_err(|e| engine_error("register", e))?;
        }
        let memory = MemoryConfig::new(true, "05:00", 120, sim.scenario.max_concurrent, "UTC", &[], 20 * 1024)
            .map_err(|e| format!("memory config: {e}"))?;
        engine.sync_memory_config(&memory).await.map_err(|e| engine_error("memory config", e))?;
        sim.model.max_concurrent = sim.scenario.max_concurrent as usize;
        sim.surfaces.push(SurfaceId::Slack { team: TEAM.into(), channel: CHANNELS[0].into(), thread_ts: None });
        sim.surfaces.push(SurfaceId::Chat { tenant: TENANT.into(), chat: GROUP_CHAT.into(), thread: None });
        sim.settle_and_check().await?;
        Ok(sim)
    }

    fn engine(&self, node: usize) -> Engine {
        self.nodes[node].as_ref().expect("every node runs between steps").engine.clone()
    }

    fn log(&self) -> Arc<dyn EventLog> {
        self.log.clone().expect("the log is open between steps")
    }

    /// Opens the sled database in `name` under the data dir, waiting for the lock a dropped
    /// handle still holds.
    fn open_db(&self, name: &str) -> SimResult<sled::Db> {
        // Closed means closed: wait until sled let go of the directory (the last handles were
        // dropped by the crash), then open; the retry below stays as a counted fallback.
        anima_engine::data_dir::wait_until_released(&self.dir.path().join(name), LOCK_WAIT)
            .map_err(|e| format!("waiting for {name}: {e}"))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            // A small page cache: the default is 1 GiB.
            match sled::Config::new().path(self.dir.path().join(name)).cache_capacity(2 * 1024 * 1024).open() {
                Ok(db) => return Ok(db),
                Err(e) if Instant::now() < deadline && e.to_string().contains("lock") => {
                    // sled's flusher thread lets go of the directory lock a moment after the
                    // last handle drops; there is no event to wait on until the log gets an
                    // explicit close, so poll the condition with a deadline.
                    LOCK_RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("reopening {name}: {e}")),
            }
        }
    }

    /// Opens the checkpoint store in `name` under the data dir, waiting for the lock a dropped
    /// handle still holds (a checkpoint write the dead node left in flight).
    fn open_checkpoints(&self, name: &str) -> SimResult<CheckpointDb> {
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match CheckpointDb::open(&self.dir.path().join(name), 2 * 1024 * 1024) {
                Ok(db) => return Ok(db),
                Err(e) if Instant::now() < deadline && e.to_string().contains("lock") => {
                    LOCK_RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(format!("reopening the checkpoints of {name}: {e}")),
            }
        }
    }

    /// Opens the log and starts every node. Node 0 is the process that holds the embedded log:
    /// its checkpoints live in the log's data dir, as with `Instance::start`.
    async fn start_process(&mut self) -> SimResult<()> {
        let db = self.open_db("node-0")?;
        let config = EmbeddedConfig { clock: self.clock.clone(), ..EmbeddedConfig::default() };
        let log: Arc<dyn EventLog> =
            Arc::new(EmbeddedLog::open(db, config).map_err(|e| format!("opening the log: {e}"))?);
        self.log = Some(log);
        for node in 0..self.nodes.len() {
            self.start_node(node).await?;
        }
        Ok(())
    }

    /// Starts a node from its own data dir (its checkpoints). A node's checkpoint store is its
    /// own, as a process's data dir is: reopening it after a crash waits until every handle of
    /// the dead node is gone, a checkpoint write it left in flight included.
    /// `CheckpointStore::write` runs on the store's checkpoint thread and finishes even when its caller was
    /// aborted: a runner restarted in-process on the same open database can have that late write
    /// land after its own and tear the checkpoint (seen here before nodes got their own
    /// databases: a restarted node's state differed from a rebuild).
    async fn start_node(&mut self, node: usize) -> SimResult<()> {
        let db = match &self.node_dbs[node] {
            Some(db) => db.clone(),
            None => {
                let db = self.open_checkpoints(&format!("node-{node}"))?;
                self.node_dbs[node] = Some(db.clone());
                db
            }
        };
        let checkpoints = CheckpointStore::open(&db, "checkpoint").map_err(|e| format!("checkpoints: {e}"))?;
        let runner_config = RunnerConfig {
            checkpoint_every_events: self.scenario.checkpoint_every_events,
            // Checkpoints follow the event count, not the wall clock.
            checkpoint_interval: Duration::from_secs(3600),
            ..RunnerConfig::default()
        };
        let shutdown = CancellationToken::new();
        let runner = Runner::start(self.log(), checkpoints, runner_config, shutdown.clone())
            .await
            .map_err(|e| format!("runner of node {node}: {e}"))?;
        // Like `Instance::start`: serve commands only once caught up with what the log held.
        let last = self.log().last_seq().await.map_err(|e| format!("last seq: {e}"))?;
        runner.projection.wait_applied(last, APPLY_WAIT).await.map_err(|e| format!("node {node} catching up: {e}"))?;
        // The heartbeat rate limit reads the instance's clock: simulated time here.
        let clock: Arc<dyn anima_engine::clock::Clock> = self.clock.clone();
        let engine = Engine::new(self.log(), runner.projection, EngineConfig { clock, ..EngineConfig::default() });
        self.nodes[node] = Some(Node { engine, runner: runner.task, shutdown });
        Ok(())
    }

    fn checkpoint_tree(&self, node: usize) -> SimResult<fjall::Keyspace> {
        let db = self.node_dbs[node].as_ref().expect("open");
        db.keyspace("checkpoint").map_err(|e| format!("checkpoint: {e}"))
    }

    /// Remembers the meta entries of each node's two newest checkpoints, for tearing.
    fn note_checkpoint_metas(&mut self) -> SimResult<()> {
        for node in 0..self.nodes.len() {
            let meta =
                self.checkpoint_tree(node)?.get(META_ENTRY_KEY).map_err(|e| format!("meta: {e}"))?.map(|v| v.to_vec());
            let entry = self.checkpoint_metas.entry(node).or_default();
            if meta.is_some() && entry.1 != meta {
                *entry = (entry.1.take(), meta);
            }
        }
        Ok(())
    }

    /// Kills a node's runner without its last checkpoint.
    async fn kill_node(&mut self, node: usize) {
        if let Some(killed) = self.nodes[node].take() {
            killed.runner.abort();
            let _ = killed.runner.await;
            drop(killed.shutdown);
            drop(killed.engine);
        }
        if node > 0 {
            self.node_dbs[node] = None;
        }
    }

    async fn kill_process(&mut self) {
        for node in 0..self.nodes.len() {
            self.kill_node(node).await;
        }
        self.log = None;
        self.node_dbs.iter_mut().for_each(|db| *db = None);
        // Heartbeat rate limits lived in the dead engines.
        self.heartbeats_appended.clear();
    }

    /// Stops every node cleanly (a last checkpoint each).
    async fn close(&mut self) -> SimResult<()> {
        for node in 0..self.nodes.len() {
            if let Some(stopped) = self.nodes[node].take() {
                stopped.shutdown.cancel();
                match stopped.runner.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return Err(format!("runner of node {node} ended with {e}")),
                    Err(e) => return Err(format!("runner of node {node}: {e}")),
                }
            }
        }
        self.log = None;
        self.node_dbs.iter_mut().for_each(|db| *db = None);
        Ok(())
    }

    /// Connectors reach either instance: the one of an observation follows from the counter.
    fn ingest_node(&self) -> usize {
        (self.counter as usize) % self.nodes.len()
    }

    fn next_ts(&mut self) -> String {
        self.counter += 1;
        format!("{}.{:06}", self.clock.now_ns() / 1_000_000_000, self.counter)
    }

    fn remember_surface(&mut self, surface: SurfaceId) {
        if !self.surfaces.contains(&surface) && self.surfaces.len() < 64 {
            self.surfaces.push(surface);
        }
    }

    /// Every node's live state equals a fresh rebuild of the raw log, byte for byte.
    async fn compare_with_rebuild(&self) -> SimResult<Arc<anima_engine::replay::Rebuilt>> {
        let rebuilt = Replayer::new(self.log(), ReplayConfig::default())
            .rebuild(None)
            .await
            .map_err(|e| format!("rebuild: {e}"))?;
        let expected = rebuilt.state.canonical_bytes();
        for (n, node) in self.nodes.iter().enumerate() {
            let node = node.as_ref().expect("running");
            let applied = node.engine.projection().applied_seq();
            let state = node.engine.projection().state();
            let live = state.canonical_bytes();
            if applied == rebuilt.seq && live != expected {
                return Err(format!(
                    "node {n}'s live state ({} bytes) differs from a rebuild of the log ({} bytes) at seq {}; {}",
                    live.len(),
                    expected.len(),
                    rebuilt.seq,
                    differing_tables(&state, &rebuilt.state)
                ));
            }
        }
        Ok(rebuilt)
    }

    async fn run_step(&mut self, step: &Step) -> SimResult<()> {
        match step {
            Step::Slack { channel, dm_of, thread, author, mention } => {
                let (channel_id, receivers) = match channel {
                    None => (dm_channel(*dm_of), vec![AGENTS[*dm_of].to_owned()]),
                    Some(c) => (CHANNELS[*c].to_owned(), AGENTS.iter().map(|a| (*a).to_owned()).collect()),
                };
                let ts = self.next_ts();
                let thread_ts = match thread {
                    Some(back) => {
                        let roots = self.roots.get(&channel_id).cloned().unwrap_or_default();
                        roots.iter().rev().nth(*back).cloned().unwrap_or_default()
                    }
                    None => String::new(),
                };
                if thread_ts.is_empty() {
                    self.roots.entry(channel_id.clone()).or_default().push(ts.clone());
                }
                let (user_id, bot) = match author {
                    Author::Human(h) => (HUMANS[*h].to_owned(), String::new()),
                    Author::Agent(a) => (bot_user_id(*a), bot_id(*a)),
                };
                let mut text = format!("message {} in {channel_id}", self.counter);
                if let Some(m) = mention {
                    text.push_str(&format!(" <@{}> can you look", bot_user_id(*m)));
                }
                let observation = SlackObservation {
                    receiving_agent_ids: receivers,
                    message: proto::SlackMessageObserved {
                        kind: proto::SlackDeliveryKind::Message as i32,
                        team_id: TEAM.into(),
                        channel_id: channel_id.clone(),
                        ts: ts.clone(),
                        thread_ts: thread_ts.clone(),
                        user_id,
                        bot_id: bot,
                        text,
                        user_name: "someone".into(),
                        ..Default::default()
                    },
                    occurred_at_ms: self.clock.now_ns() / 1_000_000,
                };
                let surface = SurfaceId::Slack {
                    team: TEAM.into(),
                    channel: channel_id.into(),
                    thread_ts: (!thread_ts.is_empty()).then_some(thread_ts.into()),
                };
                self.remember_surface(surface);
                self.deliveries.push(SlackDelivery { observation: observation.clone() });
                self.engine(self.ingest_node())
                    .ingest_slack(observation)
                    .await
                    .map_err(|e| engine_error("slack ingest", e))?;
            }
            Step::Redeliver { back } => {
                if let Some(delivery) = self.deliveries.iter().rev().nth(*back).cloned() {
                    self.engine(self.ingest_node())
                        .ingest_slack(delivery.observation)
                        .await
                        .map_err(|e| engine_error("slack redelivery", e))?;
                }
            }
            Step::Chat { p2p_of, thread, author, mention } => {
                self.counter += 1;
                let (chat_id, kind, receivers) = match p2p_of {
                    Some(a) => (p2p_chat(*a), proto::ChatKind::P2p, vec![AGENTS[*a].to_owned()]),
                    None => (
                        GROUP_CHAT.to_owned(),
                        proto::ChatKind::Group,
                        AGENTS.iter().map(|a| (*a).to_owned()).collect(),
                    ),
                };
                let sender_id = match author {
                    Author::Human(h) => CHAT_HUMANS[*h].to_owned(),
                    Author::Agent(a) => chat_user_id(*a),
                };
                let message_id = format!("m{}", self.counter);
                let thread_id = match thread {
                    Some(back) => self
                        .chat_roots
                        .get(&chat_id)
                        .and_then(|roots| roots.iter().rev().nth(*back).cloned())
                        .unwrap_or_default(),
                    None => String::new(),
                };
                if thread_id.is_empty() {
                    self.chat_roots.entry(chat_id.clone()).or_default().push(message_id.clone());
                }
                let observation = ChatObservation {
                    receiving_agent_ids: receivers,
                    message: proto::ChatMessageObserved {
                        tenant_id: TENANT.into(),
                        chat_id: chat_id.clone(),
                        chat_kind: kind as i32,
                        message_id,
                        thread_id: thread_id.clone(),
                        sender_is_bot: matches!(author, Author::Agent(_)),
                        sender_id,
                        sender_name: "someone".into(),
                        text: format!("chat message {}", self.counter),
                        mentioned_user_ids: mention.map(chat_user_id).into_iter().collect(),
                        ..Default::default()
                    },
                    occurred_at_ms: self.clock.now_ns() / 1_000_000,
                };
                let thread = (!thread_id.is_empty()).then_some(thread_id);
                self.remember_surface(SurfaceId::Chat {
                    tenant: TENANT.into(),
                    chat: chat_id.into(),
                    thread: thread.map(Into::into),
                });
                self.engine(self.ingest_node())
                    .ingest_chat(observation)
                    .await
                    .map_err(|e| engine_error("chat ingest", e))?;
            }
            Step::LinearCreated { agent } => {
                self.counter += 1;
                let session =
                    uuid::Uuid::from_u128(0x1000_0000_0000_4000_8000_0000_0000_0000 | u128::from(self.counter));
                let observation = LinearObservation {
                    event: proto::LinearSessionEvent {
                        receiving_agent_id: AGENTS[*agent].to_owned(),
                        installation_id: INSTALLATION.into(),
                        kind: proto::LinearSessionEventKind::Created as i32,
                        session_id: {
                            self.sessions.push((*agent, session.to_string()));
                            session.to_string()
                        },
                        issue_identifier: format!("ENG-{}", self.counter),
                        issue_title: "a task".into(),
                        prompt_text: "please do the task".into(),
                        ..Default::default()
                    },
                    occurred_at_ms: self.clock.now_ns() / 1_000_000,
                };
                self.engine(self.ingest_node())
                    .ingest_linear(observation)
                    .await
                    .map_err(|e| engine_error("linear ingest", e))?;
            }
            Step::LinearPrompted { back } | Step::LinearStop { back } => {
                let Some((agent, session)) = self.sessions.iter().rev().nth(*back).cloned() else { return Ok(()) };
                self.counter += 1;
                let prompted = matches!(step, Step::LinearPrompted { .. });
                let observation = LinearObservation {
                    event: proto::LinearSessionEvent {
                        receiving_agent_id: AGENTS[agent].to_owned(),
                        installation_id: INSTALLATION.into(),
                        kind: if prompted {
                            proto::LinearSessionEventKind::Prompted as i32
                        } else {
                            proto::LinearSessionEventKind::Stop as i32
                        },
                        session_id: session,
                        agent_activity_id: if prompted { format!("act{}", self.counter) } else { String::new() },
                        prompt_text: if prompted { "one more thing".into() } else { String::new() },
                        ..Default::default()
                    },
                    occurred_at_ms: self.clock.now_ns() / 1_000_000,
                };
                self.engine(self.ingest_node())
                    .ingest_linear(observation)
                    .await
                    .map_err(|e| engine_error("linear", e))?;
            }
            Step::Claim { agent, node } => self.claim(self.pick(*agent, |h| h.is_none()), *node).await?,
            Step::Start { agent, node } => {
                self.start(self.pick(*agent, |h| h.is_some_and(|h| !h.started)), *node).await?
            }
            Step::Finish { agent, node, outcome } => {
                self.finish(self.pick(*agent, |h| h.is_some_and(|h| h.started)), *node, *outcome).await?
            }
            Step::Heartbeat { agent, node } => self.heartbeat(self.pick(*agent, |h| h.is_some()), *node).await?,
            Step::Send { agent, node, anywhere, confirm } => {
                let agent =
                    if anywhere.is_none() { self.pick(*agent, |h| h.is_some_and(|h| h.started)) } else { *agent };
                self.send(agent, *node, *anywhere, *confirm).await?
            }
            Step::Mute { agent, node, surface, mute } => {
                let surface = self.surfaces[surface % self.surfaces.len()].clone();
                let direct = matches!(&surface, SurfaceId::Slack { channel, .. } if channel.starts_with('D'))
                    || matches!(&surface, SurfaceId::Chat { chat, .. } if chat.starts_with('p'));
                let result =
                    self.engine(*node).change_subscription(AGENTS[*agent], Some(surface.to_target()), *mute, "").await;
                match result {
                    Ok(_) | Err(CommandError::Refused(_)) => {}
                    // A DM or p2p chat cannot be muted: refused at the edge is fine.
                    Err(CommandError::InvalidArgument { .. }) if direct => {}
                    Err(e) => return Err(engine_error("mute", e)),
                }
            }
            Step::WorkerDies { agent } => {
                self.held.remove(agent);
            }
            Step::Advance { minutes } => self.clock.advance(Duration::from_secs(60 * *minutes as u64)),
            Step::Recover { node } => {
                self.engine(*node)
                    .recover_silent_wakes(self.clock.now_ns())
                    .await
                    .map_err(|e| engine_error("recovery tick", e))?;
                self.model.recovery_ticks_at.push(self.clock.now_ns());
                self.recovery_ticked = true;
            }
            Step::MemoryTick { node } => {
                self.engine(*node)
                    .memory_tick(self.clock.now_ns())
                    .await
                    .map_err(|e| engine_error("memory tick", e))?;
            }
            // Node 0 holds the log: its crash is the process's.
            Step::CrashNode { node: 0 } | Step::CrashAll => {
                self.model.exercised.crashes += 1;
                self.kill_process().await;
                self.start_process().await?;
            }
            Step::CrashNode { node } => {
                self.model.exercised.crashes += 1;
                self.kill_node(*node).await;
                self.heartbeats_appended.retain(|(n, _, _), _| n != node);
                self.start_node(*node).await?;
            }
            Step::TornCheckpoint { node } => {
                self.model.exercised.crashes += 1;
                // The runner dies; its database stays open to be torn (a late write of the dead
                // runner may land too: this step corrupts the checkpoint anyway).
                if let Some(killed) = self.nodes[*node].take() {
                    killed.runner.abort();
                    let _ = killed.runner.await;
                }
                self.heartbeats_appended.retain(|(n, _, _), _| n != node);
                if let Some((Some(older), _)) = self.checkpoint_metas.get(node) {
                    let tree = self.checkpoint_tree(*node)?;
                    tree.insert(META_ENTRY_KEY, older.clone()).map_err(|e| format!("tearing: {e}"))?;
                    let db = self.node_dbs[*node].as_ref().expect("open");
                    db.persist().map_err(|e| format!("tearing: {e}"))?;
                }
                self.start_node(*node).await?;
            }
            Step::CrashDuringSend { agent } => self.crash_during_send(*agent).await?,
            Step::CrashDuringIngest { channel } => {
                self.model.exercised.crashes += 1;
                let ts = self.next_ts();
                let channel_id = CHANNELS[*channel].to_owned();
                self.roots.entry(channel_id.clone()).or_default().push(ts.clone());
                let observation = SlackObservation {
                    receiving_agent_ids: AGENTS.iter().map(|a| (*a).to_owned()).collect(),
                    message: proto::SlackMessageObserved {
                        kind: proto::SlackDeliveryKind::Message as i32,
                        team_id: TEAM.into(),
                        channel_id,
                        ts,
                        user_id: HUMANS[0].to_owned(),
                        text: format!("message {} for everyone", self.counter),
                        user_name: "someone".into(),
                        ..Default::default()
                    },
                    occurred_at_ms: self.clock.now_ns() / 1_000_000,
                };
                // Each receiver's event id depends only on the message and the receiver, so the
                // first receiver alone is exactly the first record of the whole batch.
                let first = SlackObservation { receiving_agent_ids: vec![AGENTS[0].to_owned()], ..observation.clone() };
                self.engine(0).ingest_slack(first).await.map_err(|e| engine_error("slack ingest", e))?;
                self.kill_process().await;
                self.start_process().await?;
                let outcomes = self
                    .engine(self.ingest_node())
                    .ingest_slack(observation.clone())
                    .await
                    .map_err(|e| engine_error("slack ingest retried", e))?;
                if !outcomes.first().is_some_and(|o| o.duplicate_event)
                    || outcomes.iter().skip(1).any(|o| o.duplicate_event)
                {
                    return Err(format!(
                        "a retried observation: only the first receiver's event is a duplicate; got {outcomes:?}"
                    ));
                }
                self.deliveries.push(SlackDelivery { observation });
            }
        }
        Ok(())
    }

    /// The first agent from `agent` on (in a fixed rotation) whose runtime state suits the step,
    /// else `agent`: steps of the wake workflow go where they can do something.
    fn pick(&self, agent: usize, suits: impl Fn(Option<&Held>) -> bool) -> usize {
        (0..AGENTS.len()).map(|k| (agent + k) % AGENTS.len()).find(|a| suits(self.held.get(a))).unwrap_or(agent)
    }

    async fn claim(&mut self, agent: usize, node: usize) -> SimResult<()> {
        self.workers_started += 1;
        let worker = format!("w{}", self.workers_started);
        let request = proto::WakeClaimRequested {
            agent_id: AGENTS[agent].to_owned(),
            worker_id: worker.clone(),
            memory_md_bytes: 4_000,
            ..Default::default()
        };
        match self.engine(node).claim(request, "").await {
            Ok(outcome) => {
                if let Some(wake) = outcome.wake {
                    // Granted while the runtime held one: recovery re-queued that one (the model
                    // checks that it did so rightly); the runtime's old claim is gone.
                    let claimed = wake.claimed;
                    let known = self.known.entry(agent).or_default();
                    for surface in claimed.plan.iter().map(|p| &p.surface).chain([&claimed.item.reply_to]) {
                        if !known.contains(surface) && known.len() < 16 {
                            known.push(surface.clone());
                        }
                    }
                    let plan = claimed.plan.iter().map(PlanEntry::to_plan_surface).collect();
                    self.held.insert(
                        agent,
                        Held {
                            item_id: claimed.item.id.clone(),
                            worker,
                            plan,
                            reply_to: claimed.item.reply_to.clone(),
                            started: false,
                            memory: claimed.item.memory.is_some(),
                            last_heartbeat_call_ns: self.clock.now_ns(),
                        },
                    );
                }
                Ok(())
            }
            Err(CommandError::Refused(_)) => Ok(()),
            Err(e) => Err(engine_error("claim", e)),
        }
    }

    async fn start(&mut self, agent: usize, node: usize) -> SimResult<()> {
        let Some(held) = self.held.get(&agent).cloned().filter(|h| !h.started) else { return Ok(()) };
        let request = proto::WakeStartRequested {
            agent_id: AGENTS[agent].to_owned(),
            worker_id: held.worker.clone(),
            item_id: held.item_id.clone(),
            plan: held.plan.clone(),
        };
        match self.engine(node).start(request, "").await {
            Ok(_) => {
                let now = self.clock.now_ns();
                if let Some(h) = self.held.get_mut(&agent) {
                    h.started = true;
                    h.last_heartbeat_call_ns = now;
                }
                Ok(())
            }
            Err(CommandError::Refused(_)) => {
                self.held.remove(&agent);
                Ok(())
            }
            Err(e) => Err(engine_error("start", e)),
        }
    }

    async fn finish(&mut self, agent: usize, node: usize, outcome: u8) -> SimResult<()> {
        let Some(held) = self.held.get(&agent).cloned() else { return Ok(()) };
        let (outcome, restart_drain) = match outcome {
            0 => (proto::WakeOutcome::Completed, false),
            1 => (proto::WakeOutcome::Failed, false),
            2 => (proto::WakeOutcome::Aborted, false),
            _ => (proto::WakeOutcome::Aborted, true),
        };
        let request = proto::WakeFinishRequested {
            agent_id: AGENTS[agent].to_owned(),
            worker_id: held.worker.clone(),
            item_id: held.item_id.clone(),
            outcome: outcome as i32,
            reason: if outcome == proto::WakeOutcome::Completed { String::new() } else { "it broke".into() },
            restart_drain,
            memory_digest_before: if held.memory { vec![1; 32] } else { Vec::new() },
            memory_digest_after: if held.memory { vec![(self.counter % 2) as u8 + 1; 32] } else { Vec::new() },
        };
        self.held.remove(&agent);
        match self.engine(node).finish(request, "").await {
            Ok(_) | Err(CommandError::Refused(_)) => Ok(()),
            Err(e) => Err(engine_error("finish", e)),
        }
    }

    async fn heartbeat(&mut self, agent: usize, node: usize) -> SimResult<()> {
        let Some(held) = self.held.get(&agent).cloned() else { return Ok(()) };
        let now = self.clock.now_ns();
        let request = proto::WakeHeartbeat {
            agent_id: AGENTS[agent].to_owned(),
            worker_id: held.worker.clone(),
            item_id: held.item_id.clone(),
        };
        let key = (node, AGENTS[agent].to_owned(), held.item_id.clone());
        match self.engine(node).heartbeat(request).await {
            Ok(appended) => {
                if let Some(h) = self.held.get_mut(&agent) {
                    h.last_heartbeat_call_ns = now;
                }
                let due = self.heartbeats_appended.get(&key).is_none_or(|at| now - at >= HEARTBEAT_INTERVAL_NS);
                if appended {
                    self.heartbeats_appended.insert(key, now);
                } else if due {
                    if self.model.strict.heartbeat {
                        return Err(format!(
                            "a heartbeat of {} was not appended although none was for a minute of the injected clock",
                            held.item_id
                        ));
                    }
                    self.findings.heartbeats_dropped += 1;
                }
                Ok(())
            }
            Err(CommandError::Refused(_)) => {
                // Appended, then refused by the fold: it counts for the rate limit all the same.
                self.heartbeats_appended.insert(key, now);
                // Not running (recovered, or only claimed): the runtime lost it.
                if held.started {
                    self.held.remove(&agent);
                }
                Ok(())
            }
            Err(e) => Err(engine_error("heartbeat", e)),
        }
    }

    fn send_target(&self, agent: usize, anywhere: Option<usize>) -> Option<SurfaceId> {
        let held = self.held.get(&agent);
        let known = self.known.get(&agent).filter(|k| !k.is_empty());
        let surface = match (anywhere, held) {
            // Before its start: a post on a plan surface makes the plan stale.
            (Some(n), Some(held)) if !held.started && n % 2 == 0 && !held.plan.is_empty() => {
                SurfaceId::parse(&held.plan[n % held.plan.len()].surface)?
            }
            (Some(n), _) if n % 3 != 0 && known.is_some() => {
                let known = known.expect("checked");
                known[n % known.len()].clone()
            }
            (Some(n), _) => self.surfaces[n % self.surfaces.len()].clone(),
            // A memory pass reads untrusted history; one that tries to post (an injected
            // instruction) goes where the agent was woken before.
            (None, Some(held)) if held.started && held.memory && known.is_some() => known.expect("checked")[0].clone(),
            (None, Some(held)) if held.started => held.reply_to.clone(),
            _ => return None,
        };
        matches!(surface, SurfaceId::Slack { .. } | SurfaceId::Chat { .. }).then_some(surface)
    }

    fn send_request(agent: usize, surface: &SurfaceId) -> proto::SendRequested {
        proto::SendRequested {
            agent_id: AGENTS[agent].to_owned(),
            target: Some(surface.to_target()),
            kind: proto::SendKind::Message as i32,
            draft_bytes: 42,
            mentioned_user_ids: Vec::new(),
        }
    }

    async fn send(&mut self, agent: usize, node: usize, anywhere: Option<usize>, confirm: bool) -> SimResult<()> {
        let Some(surface) = self.send_target(agent, anywhere) else { return Ok(()) };
        let request_id = uuid::Uuid::from_u128(
            0xAAAA_0000_0000_4000_8000_0000_0000_0000
                | u128::from({
                    self.counter += 1;
                    self.counter
                }),
        )
        .to_string();
        self.decide_send(agent, node, &surface, &request_id, confirm).await
    }

    async fn decide_send(
        &mut self,
        agent: usize,
        node: usize,
        surface: &SurfaceId,
        request_id: &str,
        confirm: bool,
    ) -> SimResult<()> {
        let decision = match self.engine(node).send(Self::send_request(agent, surface), request_id).await {
            Ok(decision) => decision,
            Err(CommandError::Refused(_)) => return Ok(()),
            Err(e) => return Err(engine_error("send", e)),
        };
        if let Some(earlier) = self.sends.insert(decision.seq, decision.verdict.clone()) {
            if earlier != decision.verdict {
                return Err(format!(
                    "a retried send at seq {} got {:?}, the first answer was {earlier:?}",
                    decision.seq, decision.verdict
                ));
            }
        }
        if confirm && matches!(decision.verdict, SendVerdict::Allowed { .. }) {
            let ts = match surface {
                SurfaceId::Slack { .. } => self.next_ts(),
                _ => {
                    self.counter += 1;
                    format!("own{}", self.counter)
                }
            };
            let confirmation = proto::SendConfirmed {
                agent_id: AGENTS[agent].to_owned(),
                target: Some(surface.to_target()),
                kind: proto::SendKind::Message as i32,
                ts,
                text: "my answer".into(),
                files: Vec::new(),
                send_event_id: String::new(),
            };
            self.engine(node).confirm(confirmation, "").await.map_err(|e| engine_error("confirm", e))?;
        }
        Ok(())
    }

    async fn crash_during_send(&mut self, agent: usize) -> SimResult<()> {
        let Some(surface) = self.send_target(agent, Some(agent)) else { return Ok(()) };
        self.model.exercised.crashes += 1;
        self.counter += 1;
        let request_id =
            uuid::Uuid::from_u128(0xBBBB_0000_0000_4000_8000_0000_0000_0000 | u128::from(self.counter)).to_string();
        // What `Engine::send` appends (the event id is the request id), landed just before the
        // process died.
        let envelope = proto::Envelope {
            event_id: request_id.clone(),
            occurred_at_ms: 0,
            min_reader_version: 1,
            source: "anima-wake".into(),
            payload: Some(Payload::Send(Self::send_request(agent, &surface))),
        };
        let subject = self.log().subjects().surface(&surface);
        self.log()
            .append(AppendRecord {
                subject,
                msg_id: request_id.clone(),
                payload: Bytes::from(envelope.encode_to_vec()),
            })
            .await
            .map_err(|e| format!("append of the send in flight: {e}"))?;
        self.kill_process().await;
        self.start_process().await?;
        self.decide_send(agent, 0, &surface, &request_id, false).await
    }

    /// Waits until every node applied the whole log, then feeds the new events to the model.
    async fn settle_and_check(&mut self) -> SimResult<()> {
        let log = self.log();
        let last = log.last_seq().await.map_err(|e| format!("last seq: {e}"))?;
        for (n, node) in self.nodes.iter().enumerate() {
            let node = node.as_ref().expect("running");
            node.engine
                .projection()
                .wait_applied(last, APPLY_WAIT)
                .await
                .map_err(|e| format!("node {n} did not apply seq {last}: {e}"))?;
        }
        let from = self.model.checked_seq + 1;
        if from <= last {
            let mut records = log.read(from, last, None).await.map_err(|e| format!("read: {e}"))?;
            while let Some(record) = records.next().await {
                let record = record.map_err(|e| format!("read: {e}"))?;
                let envelope = proto::Envelope::decode(record.payload.as_ref())
                    .map_err(|e| format!("seq {} does not decode: {e}", record.seq))?;
                let mut verdicts = Vec::new();
                for node in self.nodes.iter().flatten() {
                    verdicts.push(node.engine.projection().state().verdict(record.seq).cloned());
                }
                if verdicts.windows(2).any(|pair| pair[0] != pair[1]) {
                    return Err(format!(
                        "the instances recorded different verdicts at seq {}: {verdicts:?}",
                        record.seq
                    ));
                }
                let verdict = verdicts.into_iter().next().flatten();
                self.model.apply(record.seq, record.timestamp_ns, &envelope, verdict.as_ref(), &self.sends)?;
                self.model.checked_seq = record.seq;
            }
        }
        for node in self.nodes.iter().flatten() {
            self.model.compare_queues(&node.engine)?;
        }
        self.note_checkpoint_metas()?;
        self.check_liveness()
    }

    fn check_liveness(&mut self) -> SimResult<()> {
        let now = self.clock.now_ns();
        if std::mem::take(&mut self.recovery_ticked) {
            for (agent, queue) in &self.model.queues {
                let Some(active) = queue.active.as_ref().filter(|a| a.started) else { continue };
                if now - active.last_alive_ns >= HEARTBEAT_SILENCE_NS {
                    return Err(format!(
                        "{agent}'s running wake {} outlived its heartbeat window: silent {} min, still running after a recovery tick",
                        active.id,
                        (now - active.last_alive_ns) / MINUTE_NS
                    ));
                }
            }
        }
        for (agent, queue) in &self.model.queues {
            let Some(active) = &queue.active else { continue };
            let abandoned = !self.held.iter().any(|(a, h)| AGENTS[*a] == agent.as_str() && h.item_id == active.id);
            let ticked_after_lease =
                self.model.recovery_ticks_at.iter().any(|t| *t >= active.claimed_at_ns + CLAIM_LEASE_NS);
            if abandoned && !active.started && ticked_after_lease && now - active.claimed_at_ns >= DAY_NS {
                if self.model.strict.stuck {
                    return Err(format!(
                        "{agent} is stuck: its claim of {} was abandoned a day ago and recovery never re-queued it",
                        active.id
                    ));
                }
                self.findings.stuck_claims.insert(format!("{agent}/{}", active.id));
            }
        }
        for (agent, item) in std::mem::take(&mut self.model.recovered_now) {
            let heartbeating =
                self.held.iter().filter(|(a, _)| AGENTS[**a] == agent.as_str()).any(|(_, h)| {
                    h.item_id == item && h.started && now - h.last_heartbeat_call_ns < HEARTBEAT_SILENCE_NS
                });
            if heartbeating {
                if self.model.strict.recovery {
                    return Err(format!(
                        "{agent}'s running wake {item} was re-queued although its runtime heartbeated within 30 minutes"
                    ));
                }
                self.findings.recovered_while_heartbeating += 1;
            }
        }
        Ok(())
    }

    /// End of a seed: a rebuild from the raw log equals every live state, and Explain agrees
    /// with every send verdict the client got.
    async fn final_checks(&mut self) -> SimResult<()> {
        let log = self.log();
        let last = log.last_seq().await.map_err(|e| format!("last seq: {e}"))?;
        for (n, node) in self.nodes.iter().enumerate() {
            let projection = node.as_ref().expect("running").engine.projection().clone();
            projection.wait_applied(last, APPLY_WAIT).await.map_err(|e| format!("node {n}: {e}"))?;
        }
        self.compare_with_rebuild().await?;
        let replayer = Replayer::new(log, ReplayConfig::default());
        for (seq, verdict) in &self.sends {
            let explained = replayer.explain(*seq).await.map_err(|e| format!("explain {seq}: {e}"))?;
            if explained.verdict.as_ref() != Some(&Verdict::Send(verdict.clone())) {
                return Err(format!(
                    "Explain of the send at seq {seq} says {:?}; the client got {verdict:?}",
                    explained.verdict
                ));
            }
            if let Some(facts) = &explained.cursor {
                let held = matches!(verdict, SendVerdict::Held(_));
                if facts.cursor.is_some() && (facts.foreign_rows_after_cursor > 0) != held {
                    return Err(format!(
                        "Explain of the send at seq {seq} counts {} foreign rows after the cursor, the verdict was {verdict:?}",
                        facts.foreign_rows_after_cursor
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Which tables of two states differ, with the first differing entry of each (for a report that
/// points at the cause).
fn differing_tables(live: &anima_projections::State, rebuilt: &anima_projections::State) -> String {
    let mut out = Vec::new();
    if live.meta != rebuilt.meta {
        out.push(format!("meta: live {:?}, rebuilt {:?}", live.meta, rebuilt.meta));
    }
    macro_rules! tables {
        ($($field:ident),*) => {$(
            if live.$field != rebuilt.$field {
                let first = live.$field.iter().zip(rebuilt.$field.iter()).find(|(a, b)| a != b);
                out.push(format!(
                    "{} ({} live vs {} rebuilt entries; first difference {first:?})",
                    stringify!($field),
                    live.$field.len(),
                    rebuilt.$field.len()
                ));
            }
        )*};
    }
    tables!(
        agents,
        slack_identities,
        surface_count,
        queues,
        verdicts,
        chat_identities,
        linear_receipt_count,
        linear_response_count,
        linear_unknown_responses,
        memory_config,
        memory_gates,
        memory_open
    );
    macro_rules! cold_tables {
        ($($tag:literal => $field:ident),*) => {$(
            let (a, b) = (live.$field.all_entries($tag, &live.cold), rebuilt.$field.all_entries($tag, &rebuilt.cold));
            if a != b {
                let first = a.iter().zip(b.iter()).find(|(a, b)| a != b);
                out.push(format!(
                    "{} ({} live vs {} rebuilt entries; first difference {first:?})",
                    stringify!($field),
                    a.len(),
                    b.len()
                ));
            }
        )*};
    }
    cold_tables!(39 => surface_keys, 40 => surface_ids, 42 => journals, 43 => cursors, 4 => identities, 5 => identity_order, 26 => journal_rows, 33 => settled_ids, 34 => settled_order, 11 => subscriptions, 14 => linear_receipts, 15 => linear_receipt_order, 24 => linear_sessions, 25 => linear_session_order, 16 => linear_responses, 17 => linear_activities, 18 => linear_response_order, 44 => chat_kinds, 45 => dm_members);
    if live.agent_keys != rebuilt.agent_keys {
        out.push("interned keys".to_owned());
    }
    format!("differing: {}", out.join("; "))
}

// ---------------------------------------------------------------------------------------------
// The independent model: what the design says the fold must have done, from the raw log.

#[derive(Clone, Debug)]
struct ModelRow {
    /// The agent whose identity wrote it (foreign to every other agent).
    owner: Option<String>,
}

#[derive(Clone, Debug)]
struct ModelItem {
    id: String,
    /// Trigger surface and ordinal (none for Linear and memory items).
    trigger: Option<(SurfaceId, u64)>,
    resume: bool,
    memory: Option<String>,
    /// The Linear session of a Linear item.
    session: Option<String>,
}

#[derive(Clone, Debug)]
struct ModelActive {
    id: String,
    item: ModelItem,
    worker: String,
    plan: Vec<(SurfaceId, Option<u64>, u64)>,
    started: bool,
    claimed_at_ns: i64,
    last_alive_ns: i64,
}

#[derive(Clone, Debug, Default)]
struct ModelQueue {
    queued: VecDeque<ModelItem>,
    active: Option<ModelActive>,
}

/// What the checked events exercised, summed over seeds: a run that never holds a send or never
/// starts a wake checks little, so the summary line says what was covered.
#[derive(Clone, Debug, Default)]
struct Exercised {
    events: u64,
    sends_allowed_with_cursor: u64,
    sends_allowed_without_cursor: u64,
    sends_held: u64,
    starts: u64,
    stale_starts: u64,
    coalesced: u64,
    settled_at_claim: u64,
    finishes: u64,
    requeued: u64,
    recovered: u64,
    passes_queued: u64,
    crashes: u64,
}

impl Exercised {
    fn add(&mut self, other: &Exercised) {
        self.events += other.events;
        self.sends_allowed_with_cursor += other.sends_allowed_with_cursor;
        self.sends_allowed_without_cursor += other.sends_allowed_without_cursor;
        self.sends_held += other.sends_held;
        self.starts += other.starts;
        self.stale_starts += other.stale_starts;
        self.coalesced += other.coalesced;
        self.settled_at_claim += other.settled_at_claim;
        self.finishes += other.finishes;
        self.requeued += other.requeued;
        self.recovered += other.recovered;
        self.passes_queued += other.passes_queued;
        self.crashes += other.crashes;
    }
}

#[derive(Default)]
struct Model {
    /// Which known deviations fail instead of being counted.
    strict: Strict,
    /// Held sends whose notice counted more new messages than foreign rows arrived.
    held_counts_own_rows: u64,
    /// Sends allowed while the agent's running wake was a memory pass.
    sends_during_memory_pass: u64,
    exercised: Exercised,
    checked_seq: u64,
    max_concurrent: usize,
    journals: BTreeMap<SurfaceId, Vec<ModelRow>>,
    /// Message identity → (surface, ordinal) of its row.
    identities: BTreeMap<String, (SurfaceId, u64)>,
    cursors: BTreeMap<(String, SurfaceId), u64>,
    queues: BTreeMap<String, ModelQueue>,
    /// (agent, item id) → log time it settled.
    settled: BTreeMap<(String, String), i64>,
    /// (agent, window-day) of every pass ever queued.
    passes: BTreeSet<(String, String)>,
    /// Sim times of recovery ticks.
    recovery_ticks_at: Vec<i64>,
    /// (agent, item) recovered by the last events applied, for the liveness check.
    recovered_now: Vec<(String, String)>,
}

fn slack_owner(user_id: &str, bot: &str) -> Option<String> {
    (0..AGENTS.len())
        .find(|n| user_id == bot_user_id(*n) || bot == bot_id(*n) || bot == bot_user_id(*n))
        .map(|n| AGENTS[n].to_owned())
}

fn chat_owner(sender_id: &str) -> Option<String> {
    (0..AGENTS.len()).find(|n| sender_id == chat_user_id(*n)).map(|n| AGENTS[n].to_owned())
}

impl Model {
    fn tail(&self, surface: &SurfaceId) -> u64 {
        self.journals.get(surface).map_or(0, |rows| rows.len() as u64)
    }

    /// Journals a row under `identity` (first sight), returning its ordinal and whether it is new.
    fn journal(&mut self, identity: String, surface: SurfaceId, owner: Option<String>) -> (u64, bool) {
        if let Some((_, ordinal)) = self.identities.get(&identity) {
            return (*ordinal, false);
        }
        let rows = self.journals.entry(surface.clone()).or_default();
        rows.push(ModelRow { owner });
        let ordinal = rows.len() as u64;
        self.identities.insert(identity, (surface, ordinal));
        (ordinal, true)
    }

    fn queue(&mut self, agent: &str) -> &mut ModelQueue {
        self.queues.entry(agent.to_owned()).or_default()
    }

    fn settle(&mut self, agent: &str, id: &str, at_ns: i64, seq: u64) -> SimResult<()> {
        if let Some(earlier) = self.settled.insert((agent.to_owned(), id.to_owned()), at_ns) {
            if at_ns - earlier < SETTLED_REMEMBERED_NS {
                return Err(format!("seq {seq}: item {id} of {agent} settled a second time"));
            }
        }
        Ok(())
    }

    /// A new item for `agent`: never one that is queued, active, or settled within 14 days.
    fn enqueue(&mut self, agent: &str, item: ModelItem, at_ns: i64, seq: u64) -> SimResult<()> {
        let queue = self.queue(agent);
        if queue.queued.iter().any(|i| i.id == item.id) || queue.active.as_ref().is_some_and(|a| a.id == item.id) {
            return Err(format!("seq {seq}: item {} of {agent} queued while it is queued or active", item.id));
        }
        if let Some(settled) = self.settled.get(&(agent.to_owned(), item.id.clone())) {
            if at_ns - settled < SETTLED_REMEMBERED_NS {
                return Err(format!("seq {seq}: settled item {} of {agent} came back", item.id));
            }
        }
        self.queue(agent).queued.push_back(item);
        Ok(())
    }

    fn foreign_after(&self, agent: &str, surface: &SurfaceId, cursor: u64) -> u64 {
        self.journals.get(surface).map_or(0, |rows| {
            rows.iter().skip(cursor as usize).filter(|r| r.owner.as_deref() != Some(agent)).count() as u64
        })
    }

    fn covered(&self, agent: &str, item: &ModelItem) -> bool {
        !item.resume
            && item.trigger.as_ref().is_some_and(|(surface, ordinal)| {
                self.cursors.get(&(agent.to_owned(), surface.clone())).is_some_and(|c| c >= ordinal)
            })
    }

    fn open_passes(&self) -> usize {
        self.queues
            .values()
            .map(|q| {
                q.queued.iter().filter(|i| i.memory.is_some()).count()
                    + usize::from(q.active.as_ref().is_some_and(|a| a.item.memory.is_some()))
            })
            .sum()
    }

    fn apply(
        &mut self,
        seq: u64,
        at_ns: i64,
        envelope: &proto::Envelope,
        verdict: Option<&Verdict>,
        sends: &BTreeMap<u64, SendVerdict>,
    ) -> SimResult<()> {
        let Some(payload) = &envelope.payload else { return Ok(()) };
        self.exercised.events += 1;
        let refused = matches!(verdict, Some(Verdict::Refused(_)));
        match payload {
            Payload::SlackMessage(m) => {
                let thread = (!m.thread_ts.is_empty() && m.thread_ts != m.ts).then(|| m.thread_ts.clone());
                let surface = SurfaceId::Slack {
                    team: m.team_id.as_str().into(),
                    channel: m.channel_id.as_str().into(),
                    thread_ts: thread.map(Into::into),
                };
                let identity = format!("slack:{}:{}:{}", m.team_id, m.channel_id, m.ts);
                let (ordinal, new) =
                    self.journal(identity.clone(), surface.clone(), slack_owner(&m.user_id, &m.bot_id));
                self.journaled(seq, at_ns, verdict, &m.receiving_agent_id, identity, surface, ordinal, new)?;
            }
            Payload::ChatMessage(m) => {
                let thread = (!m.thread_id.is_empty()).then(|| m.thread_id.clone());
                let surface = SurfaceId::Chat {
                    tenant: m.tenant_id.as_str().into(),
                    chat: m.chat_id.as_str().into(),
                    thread: thread.map(Into::into),
                };
                let identity = format!("chat:{}:{}:{}", m.tenant_id, m.chat_id, m.message_id);
                let (ordinal, new) = self.journal(identity.clone(), surface.clone(), chat_owner(&m.sender_id));
                self.journaled(seq, at_ns, verdict, &m.receiving_agent_id, identity, surface, ordinal, new)?;
            }
            Payload::SendConfirmed(c) => {
                let surface = c.target.as_ref().and_then(SurfaceId::from_target).ok_or("confirm without target")?;
                let identity = match &surface {
                    SurfaceId::Slack { team, channel, .. } => format!("slack:{team}:{channel}:{}", c.ts),
                    SurfaceId::Chat { tenant, chat, .. } => format!("chat:{tenant}:{chat}:{}", c.ts),
                    _ => return Err(format!("seq {seq}: a confirm to {surface}")),
                };
                let (ordinal, _) = self.journal(identity, surface, Some(c.agent_id.clone()));
                match verdict {
                    Some(Verdict::Journaled(j)) if j.ordinal == ordinal => {}
                    other => {
                        return Err(format!("seq {seq}: confirmed post is row {ordinal}; the fold recorded {other:?}"))
                    }
                }
            }
            Payload::LinearSession(event) => {
                let Some(Verdict::LinearSession(v)) = verdict else {
                    return Err(format!("seq {seq}: a Linear session event got {verdict:?}"));
                };
                let agent = &event.receiving_agent_id;
                if event.kind == proto::LinearSessionEventKind::Stop as i32 {
                    // A stop removes the session's queued input, in queue order; a claimed or
                    // running one stays.
                    let queue = self.queue(agent);
                    let of_session: Vec<String> = queue
                        .queued
                        .iter()
                        .filter(|i| i.session.as_deref() == Some(event.session_id.as_str()))
                        .map(|i| i.id.clone())
                        .collect();
                    if of_session != v.removed {
                        return Err(format!(
                            "seq {seq}: the stop removed {:?}; queued of the session: {of_session:?}",
                            v.removed
                        ));
                    }
                    queue.queued.retain(|i| i.session.as_deref() != Some(event.session_id.as_str()));
                } else if v.wake.is_some() {
                    let receipt = v.receipt.clone().ok_or("a Linear wake without a receipt")?;
                    let expected = if event.kind == proto::LinearSessionEventKind::Prompted as i32 {
                        format!("linear:{}:prompted:{}", event.installation_id, event.agent_activity_id)
                    } else {
                        format!("linear:{}:created:{}", event.installation_id, event.session_id)
                    };
                    if receipt != expected {
                        return Err(format!("seq {seq}: Linear receipt {receipt}, expected {expected}"));
                    }
                    let item = ModelItem {
                        id: receipt,
                        trigger: None,
                        resume: false,
                        memory: None,
                        session: Some(event.session_id.clone()),
                    };
                    self.enqueue(agent, item, at_ns, seq)?;
                }
            }
            Payload::Send(request) => self.send(seq, request, verdict, sends)?,
            Payload::WakeClaim(request) => self.claim(seq, at_ns, request, verdict)?,
            Payload::WakeStart(request) => self.start(seq, at_ns, request, verdict)?,
            Payload::WakeHeartbeat(request) => {
                let queue = self.queue(&request.agent_id);
                match (&mut queue.active, verdict) {
                    (Some(active), Some(Verdict::HeartbeatRecorded))
                        if active.id == request.item_id && active.worker == request.worker_id =>
                    {
                        active.last_alive_ns = at_ns;
                    }
                    (Some(active), Some(Verdict::Refused(refusal)))
                        if active.id == request.item_id
                            && active.worker == request.worker_id
                            && !active.started
                            && refusal.kind == RefusalKind::Aborted =>
                    {
                        // A heartbeat after a claim's lease ran out finds it dead: queued again.
                        if at_ns - active.last_alive_ns < CLAIM_LEASE_NS {
                            return Err(format!(
                                "seq {seq}: a heartbeat of the live claim {} was refused",
                                request.item_id
                            ));
                        }
                        let item = queue.active.take().expect("active").item;
                        queue.queued.push_front(item);
                    }
                    (_, Some(Verdict::HeartbeatRecorded)) => {
                        return Err(format!(
                            "seq {seq}: a heartbeat was recorded for {} that is not active",
                            request.item_id
                        ))
                    }
                    _ => {}
                }
            }
            Payload::WakeRecovery(request) => {
                if let Some(Verdict::Recovered { item_id, .. }) = verdict {
                    let queue = self.queue(&request.agent_id);
                    let Some(active) = queue.active.take().filter(|a| &a.id == item_id) else {
                        return Err(format!("seq {seq}: recovered {item_id}, which was not active"));
                    };
                    let silent = at_ns - active.last_alive_ns;
                    let lease_over = !active.started && silent >= CLAIM_LEASE_NS.min(MINUTE_NS);
                    if silent < HEARTBEAT_SILENCE_NS && !lease_over {
                        return Err(format!(
                            "seq {seq}: recovered {item_id} after {} s of silence",
                            silent / 1_000_000_000
                        ));
                    }
                    // Only a started wake may have had side effects to continue after; a claim
                    // re-queued after its lease goes back as it was.
                    let mut item = active.item;
                    item.resume |= active.started;
                    queue.queued.push_front(item);
                    self.recovered_now.push((request.agent_id.clone(), item_id.clone()));
                    self.exercised.recovered += 1;
                }
            }
            Payload::WakeFinish(request) => {
                if refused {
                    return Ok(());
                }
                let Some(Verdict::Finished { item_id, requeued, .. }) = verdict else {
                    return Err(format!("seq {seq}: a finish got {verdict:?}"));
                };
                self.exercised.finishes += 1;
                self.exercised.requeued += u64::from(*requeued);
                let queue = self.queue(&request.agent_id);
                let Some(active) = queue.active.take().filter(|a| &a.id == item_id && a.worker == request.worker_id)
                else {
                    return Err(format!("seq {seq}: finished {item_id}, which was not active for that worker"));
                };
                if *requeued {
                    let mut item = active.item;
                    item.resume = true;
                    queue.queued.push_front(item);
                } else {
                    self.settle(&request.agent_id, item_id, at_ns, seq)?;
                }
            }
            Payload::MemoryPass(request) => {
                if let Some(Verdict::MemoryPassQueued { agent, pass_id, window_day, .. }) = verdict {
                    if self.open_passes() >= self.max_concurrent {
                        return Err(format!(
                            "seq {seq}: pass {pass_id} queued with {} passes open; maxConcurrent is {}",
                            self.open_passes(),
                            self.max_concurrent
                        ));
                    }
                    if !self.passes.insert((agent.clone(), window_day.clone())) {
                        return Err(format!("seq {seq}: a second pass for {agent} on {window_day}"));
                    }
                    // One zone (UTC) and a window 05:00 + 120 minutes: the slot lies inside that
                    // window of its window-day, and the pass is due by log time.
                    let slot = jiff::Timestamp::from_millisecond(request.slot_at_ms)
                        .map_err(|e| format!("seq {seq}: slot_at_ms: {e}"))?
                        .in_tz("UTC")
                        .map_err(|e| format!("UTC: {e}"))?;
                    let minutes = i64::from(slot.hour()) * 60 + i64::from(slot.minute());
                    if slot.date().to_string() != *window_day || !(5 * 60..7 * 60).contains(&minutes) {
                        return Err(format!("seq {seq}: pass {pass_id} for window-day {window_day} at slot {slot}"));
                    }
                    if request.slot_at_ms * 1_000_000 > at_ns {
                        return Err(format!("seq {seq}: pass {pass_id} queued before its slot {slot}"));
                    }
                    self.exercised.passes_queued += 1;
                    if agent != &request.agent_id {
                        return Err(format!("seq {seq}: a pass requested for {} queued for {agent}", request.agent_id));
                    }
                    let item = ModelItem {
                        id: pass_id.clone(),
                        trigger: None,
                        resume: false,
                        memory: Some(window_day.clone()),
                        session: None,
                    };
                    self.enqueue(agent, item, at_ns, seq)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn journaled(
        &mut self,
        seq: u64,
        at_ns: i64,
        verdict: Option<&Verdict>,
        agent: &str,
        identity: String,
        surface: SurfaceId,
        ordinal: u64,
        new: bool,
    ) -> SimResult<()> {
        let Some(Verdict::Journaled(journaled)) = verdict else {
            return Err(format!("seq {seq}: an observation got {verdict:?}"));
        };
        if journaled.ordinal != ordinal
            || journaled.surface.as_ref() != Some(&surface)
            || journaled.duplicate_message == new
        {
            return Err(format!(
                "seq {seq}: the message is row {ordinal} of {surface} (new: {new}); the fold recorded {journaled:?}"
            ));
        }
        if journaled.wake.is_some() {
            let item = ModelItem {
                id: identity,
                trigger: Some((surface, ordinal)),
                resume: false,
                memory: None,
                session: None,
            };
            self.enqueue(agent, item, at_ns, seq)?;
        }
        Ok(())
    }

    fn send(
        &mut self,
        seq: u64,
        request: &proto::SendRequested,
        verdict: Option<&Verdict>,
        sends: &BTreeMap<u64, SendVerdict>,
    ) -> SimResult<()> {
        let agent = &request.agent_id;
        let surface = request.target.as_ref().and_then(SurfaceId::from_target).ok_or("send without target")?;
        let Some(Verdict::Send(decided)) = verdict else {
            return Ok(());
        };
        // The client's answer, when it has one yet (a send in flight gets it after the restart).
        if let Some(answered) = sends.get(&seq) {
            if answered != decided {
                return Err(format!("seq {seq}: the client got {answered:?}, the fold recorded {decided:?}"));
            }
        }
        // While the agent's running wake is a memory pass, its sends are refused.
        let sealed = self
            .queues
            .get(agent)
            .and_then(|q| q.active.as_ref())
            .is_some_and(|a| a.started && a.item.memory.is_some());
        if sealed && matches!(decided, SendVerdict::Allowed { .. }) {
            if self.strict.sealed {
                return Err(format!("seq {seq}: a send of {agent} was allowed while its memory pass runs"));
            }
            self.sends_during_memory_pass += 1;
        }
        let key = (agent.clone(), surface.clone());
        let tail = self.tail(&surface);
        let cursor = self.cursors.get(&key).copied();
        match (cursor, decided) {
            (None, SendVerdict::Allowed { cursor_before: None, .. }) => {
                self.exercised.sends_allowed_without_cursor += 1
            }
            (_, SendVerdict::NotContacted(refused)) => {
                return Err(format!(
                    "seq {seq}: no do-not-contact list is configured, yet the fold refused {refused:?}"
                ))
            }
            (None, other) => {
                return Err(format!("seq {seq}: {agent} has no cursor on {surface}; the fold decided {other:?}"))
            }
            (Some(c), SendVerdict::Allowed { cursor_before, cursor_after, .. }) => {
                let foreign = self.foreign_after(agent, &surface, c);
                if foreign > 0 {
                    return Err(format!(
                        "seq {seq}: a send of {agent} to {surface} was allowed over {foreign} foreign rows after its cursor {c} (tail {tail})"
                    ));
                }
                if *cursor_before != Some(c) || *cursor_after != Some(tail) {
                    return Err(format!("seq {seq}: cursor {c}→{tail} expected; the fold recorded {decided:?}"));
                }
                self.cursors.insert(key, tail);
                self.exercised.sends_allowed_with_cursor += 1;
            }
            (Some(c), SendVerdict::Held(held)) => {
                self.exercised.sends_held += 1;
                let foreign = self.foreign_after(agent, &surface, c);
                if foreign == 0 {
                    return Err(format!(
                        "seq {seq}: a send of {agent} to {surface} was held with no foreign row after {c}"
                    ));
                }
                // The notice counts the new foreign messages, not the agent's own.
                if held.new_messages != foreign {
                    if self.strict.held_count {
                        return Err(format!(
                            "seq {seq}: the held notice says {} new messages; {foreign} foreign rows follow the cursor {c}",
                            held.new_messages
                        ));
                    }
                    self.held_counts_own_rows += 1;
                }
                if held.cursor_before != c || held.tail != tail {
                    return Err(format!("seq {seq}: held at cursor {c}, tail {tail} expected; recorded {held:?}"));
                }
                self.cursors.insert(key, tail);
            }
        }
        Ok(())
    }

    fn claim(
        &mut self,
        seq: u64,
        at_ns: i64,
        request: &proto::WakeClaimRequested,
        verdict: Option<&Verdict>,
    ) -> SimResult<()> {
        let agent = request.agent_id.clone();
        let (settled, claimed) = match verdict {
            Some(Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn, .. })) => {
                (settled_without_turn.clone(), None)
            }
            Some(Verdict::Claim(ClaimVerdict::Claimed(c))) => (c.settled_without_turn.clone(), Some(c)),
            _ => return Ok(()),
        };
        if let Some(active) = &self.queue(&agent).active {
            return Err(format!("seq {seq}: a claim for {agent} was decided while {} is active", active.id));
        }
        // Items settled on the way are the covered front of the queue, in order.
        for id in &settled {
            let front = self.queue(&agent).queued.pop_front();
            match front {
                Some(item) if &item.id == id && self.covered(&agent, &item) => {
                    self.exercised.settled_at_claim += 1;
                    self.settle(&agent, id, at_ns, seq)?;
                }
                other => {
                    return Err(format!(
                        "seq {seq}: the claim settled {id} without a turn; the model's front was {other:?}"
                    ))
                }
            }
        }
        let next = self.queue(&agent).queued.front().cloned();
        match (claimed, next) {
            (None, None) => {}
            (None, Some(item)) => {
                return Err(format!("seq {seq}: nothing claimed for {agent} although {} waits", item.id))
            }
            (Some(c), Some(item)) if c.item.id == item.id => {
                if self.covered(&agent, &item) {
                    return Err(format!("seq {seq}: claimed {} although a cursor covers its trigger", item.id));
                }
                self.queue(&agent).queued.pop_front();
                let plan = c.plan.iter().map(|p| (p.surface.clone(), p.expected, p.target)).collect::<Vec<_>>();
                for (surface, expected, target) in &plan {
                    let cursor = self.cursors.get(&(agent.clone(), surface.clone())).copied();
                    if cursor != *expected || *target > self.tail(surface) || expected.is_some_and(|e| *target < e) {
                        return Err(format!(
                            "seq {seq}: the plan of {} expects {expected:?}→{target} on {surface}; the model has cursor {cursor:?}, tail {}",
                            item.id,
                            self.tail(surface)
                        ));
                    }
                }
                self.queue(&agent).active = Some(ModelActive {
                    id: item.id.clone(),
                    item,
                    worker: request.worker_id.clone(),
                    plan,
                    started: false,
                    claimed_at_ns: at_ns,
                    last_alive_ns: at_ns,
                });
            }
            (Some(c), next) => {
                return Err(format!("seq {seq}: claimed {}; the model's next item is {next:?}", c.item.id));
            }
        }
        Ok(())
    }

    fn start(
        &mut self,
        seq: u64,
        at_ns: i64,
        request: &proto::WakeStartRequested,
        verdict: Option<&Verdict>,
    ) -> SimResult<()> {
        let agent = request.agent_id.clone();
        let Some(active) = self.queue(&agent).active.clone() else {
            return match verdict {
                Some(Verdict::Refused(_)) => Ok(()),
                other => Err(format!("seq {seq}: a start with nothing claimed got {other:?}")),
            };
        };
        let ours = active.id == request.item_id && active.worker == request.worker_id && !active.started;
        let fresh = active
            .plan
            .iter()
            .all(|(surface, expected, _)| self.cursors.get(&(agent.clone(), surface.clone())).copied() == *expected);
        match verdict {
            Some(Verdict::Started { item_id, coalesced, .. }) => {
                if !ours || !fresh {
                    return Err(format!("seq {seq}: start of {item_id} accepted (ours: {ours}, plan fresh: {fresh})"));
                }
                for (surface, _, target) in &active.plan {
                    let cursor = self.cursors.entry((agent.clone(), surface.clone())).or_insert(0);
                    *cursor = (*cursor).max(*target);
                }
                let queue = self.queue(&agent);
                let a = queue.active.as_mut().expect("active");
                a.started = true;
                a.last_alive_ns = at_ns;
                // Coalescing: the queued items the moved cursors now cover settle without a turn.
                let plan_surfaces: Vec<SurfaceId> = active.plan.iter().map(|p| p.0.clone()).collect();
                let queued: Vec<ModelItem> = self.queue(&agent).queued.iter().cloned().collect();
                let covered: Vec<String> = queued
                    .iter()
                    .filter(|i| i.trigger.as_ref().is_some_and(|(s, _)| plan_surfaces.contains(s)))
                    .filter(|i| self.covered(&agent, i))
                    .map(|i| i.id.clone())
                    .collect();
                if &covered != coalesced {
                    return Err(format!("seq {seq}: the start coalesced {coalesced:?}; the model covers {covered:?}"));
                }
                self.queue(&agent).queued.retain(|i| !covered.contains(&i.id));
                self.exercised.starts += 1;
                self.exercised.coalesced += covered.len() as u64;
                for id in &covered {
                    self.settle(&agent, id, at_ns, seq)?;
                }
            }
            Some(Verdict::Refused(_)) if ours && !fresh => {
                // A stale plan hands the item back to the front of the queue.
                self.exercised.stale_starts += 1;
                let queue = self.queue(&agent);
                let item = queue.active.take().expect("active").item;
                queue.queued.push_front(item);
            }
            Some(Verdict::Refused(refusal))
                if ours && refusal.kind == RefusalKind::Aborted && at_ns - active.last_alive_ns >= CLAIM_LEASE_NS =>
            {
                // The claim's lease ran out before the start: the item is queued again.
                let queue = self.queue(&agent);
                let item = queue.active.take().expect("active").item;
                queue.queued.push_front(item);
            }
            Some(Verdict::Refused(refusal)) if ours => {
                return Err(format!(
                    "seq {seq}: start of {} refused with a fresh plan: {}",
                    active.id, refusal.message
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// The engine's queues equal the model's: same items in the same order, same active item.
    fn compare_queues(&self, engine: &Engine) -> SimResult<()> {
        let state = engine.projection().state();
        for agent in AGENTS {
            let model = self.queues.get(agent).cloned().unwrap_or_default();
            let expected_queued: Vec<&str> = model.queued.iter().map(|i| i.id.as_str()).collect();
            let expected_active = model.active.as_ref().map(|a| (a.id.as_str(), a.started));
            let queued_items = state.queued_items(agent);
            let queued: Vec<&str> = queued_items.iter().map(|i| i.id.as_str()).collect();
            let active = state
                .queue(agent)
                .and_then(|q| q.active.as_ref())
                .map(|a| (a.item.id.as_str(), a.started_seq.is_some()));
            if queued != expected_queued || active != expected_active {
                return Err(format!(
                    "{agent}'s queue is {queued:?} active {active:?}; the model has {expected_queued:?} active {expected_active:?}"
                ));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Running seeds, shrinking failures.

/// Runs a scenario; `Err((index of the failed step, or None for the end checks, message))` on
/// the first failed check.
async fn run_scenario(scenario: Scenario, strict: Strict) -> Result<(Findings, Exercised), (Option<usize>, String)> {
    let list = scenario.steps.clone();
    let mut sim = Sim::open(scenario).await.map_err(|e| (None, format!("opening: {e}")))?;
    sim.model.strict = strict;
    for (index, step) in list.iter().enumerate() {
        sim.run_step(step).await.map_err(|e| (Some(index), e))?;
        sim.settle_and_check().await.map_err(|e| (Some(index), e))?;
        if matches!(
            step,
            Step::CrashNode { .. }
                | Step::CrashAll
                | Step::CrashDuringSend { .. }
                | Step::CrashDuringIngest { .. }
                | Step::TornCheckpoint { .. }
        ) {
            // A restarted instance resumed from its checkpoint: it must equal a rebuild.
            sim.compare_with_rebuild().await.map_err(|e| (Some(index), e))?;
        }
    }
    sim.final_checks().await.map_err(|e| (None, e))?;
    sim.close().await.map_err(|e| (None, e))?;
    sim.findings.held_counts_own_rows = sim.model.held_counts_own_rows;
    sim.findings.sends_during_memory_pass = sim.model.sends_during_memory_pass;
    Ok((sim.findings, sim.model.exercised))
}

/// Reruns of a failing seed spent on shrinking it at most.
const SHRINK_RUNS_MAX: usize = 300;

/// Shrinks a failing scenario: first the shortest failing prefix (the end checks need a search),
/// then drops chunks of steps (halves, quarters, ... single steps) while it still fails. Steps
/// are plain data, so any subsequence is a valid scenario. Returns the steps and the failure.
/// The words of a failure that do not vary with ids and numbers: a shrunk scenario must fail
/// the same way, not find another failure on the way.
fn failure_kind(message: &str) -> Vec<String> {
    message
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| w.len() >= 4 && w.chars().all(|c| c.is_ascii_lowercase()))
        .take(6)
        .map(str::to_owned)
        .collect()
}

async fn shrink(failing: Scenario, failed_at: Option<usize>, first_error: &str, strict: Strict) -> (Vec<Step>, String) {
    let kind = failure_kind(first_error);
    let runs = std::cell::Cell::new(0usize);
    let attempt = |steps: Vec<Step>| {
        runs.set(runs.get() + 1);
        let scenario = Scenario { steps, ..failing.clone() };
        let kind = kind.clone();
        async move { run_scenario(scenario, strict).await.err().map(|(_, e)| e).filter(|e| failure_kind(e) == kind) }
    };
    let mut steps = failing.steps.clone();
    steps.truncate(failed_at.map_or(steps.len(), |i| i + 1));
    let mut message = None;
    let (mut low, mut high) = (0, steps.len());
    while low < high {
        let mid = (low + high) / 2;
        match attempt(steps[..mid].to_vec()).await {
            Some(e) => {
                high = mid;
                message = Some(e);
            }
            None => low = mid + 1,
        }
    }
    steps.truncate(high);
    let mut message = match message {
        Some(e) => e,
        None => match attempt(steps.clone()).await {
            Some(e) => e,
            None => return (steps, "(the prefix passed when rerun: the failure depends on timing)".into()),
        },
    };
    let mut chunk = steps.len().div_ceil(2);
    while chunk >= 1 && runs.get() < SHRINK_RUNS_MAX {
        let mut start = 0;
        while start < steps.len() && runs.get() < SHRINK_RUNS_MAX {
            let mut fewer = steps.clone();
            fewer.drain(start..(start + chunk).min(steps.len()));
            match attempt(fewer.clone()).await {
                Some(e) => {
                    steps = fewer;
                    message = e;
                }
                None => start += chunk,
            }
        }
        if chunk == 1 {
            break;
        }
        chunk = chunk.div_ceil(2);
    }
    (steps, message)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engine_keeps_its_invariants_under_random_interleavings_and_crashes() {
    let steps = env_u64("ANIMA_SIM_STEPS").map_or(STEPS_DEFAULT, |s| s as usize);
    let seeds: Vec<u64> = match env_u64("ANIMA_SIM_SEED") {
        Some(seed) => vec![seed],
        None => (0..env_u64("ANIMA_SIM_SEEDS").unwrap_or(SEEDS_DEFAULT)).collect(),
    };
    let strict = Strict::from_env();
    let started = Instant::now();
    let mut findings = Findings::default();
    let mut stuck_seeds = 0u64;
    let mut exercised = Exercised::default();
    // Seeds are independent (own data dir, own clock), so several may run at once; each stays
    // deterministic.
    let parallel = env_u64("ANIMA_SIM_PARALLEL").map_or(SEEDS_IN_FLIGHT_DEFAULT, |p| p.max(1) as usize);
    let mut runs = futures::stream::iter(seeds.iter().copied())
        .map(|seed| async move {
            let generated = scenario(seed, steps);
            (seed, generated.clone(), run_scenario(generated, strict).await)
        })
        .buffer_unordered(parallel);
    let mut failure = None;
    while let Some((seed, generated, outcome)) = runs.next().await {
        match outcome {
            Ok((found, covered)) => {
                exercised.add(&covered);
                findings.heartbeats_dropped += found.heartbeats_dropped;
                findings.recovered_while_heartbeating += found.recovered_while_heartbeating;
                findings.held_counts_own_rows += found.held_counts_own_rows;
                findings.sends_during_memory_pass += found.sends_during_memory_pass;
                stuck_seeds += u64::from(!found.stuck_claims.is_empty());
            }
            Err((at, error)) => {
                failure = Some((seed, generated, at, error));
                break;
            }
        }
    }
    drop(runs);
    if let Some((seed, generated, at, error)) = failure {
        let (shrunk, shrunk_error) = shrink(generated.clone(), at, &error, strict).await;
        let shown: Vec<String> = shrunk.iter().map(|s| format!("    {s:?}")).collect();
        panic!(
            "simulation seed {seed} failed{}: {error}\n\
             shrunk to {} of its steps ({} instance(s), maxConcurrent {}, checkpoint every {} events), failing with: {shrunk_error}\n{}\n\
             rerun: ANIMA_SIM_SEED={seed} ANIMA_SIM_STEPS={steps}{} cargo test -p anima-engine --test it simulation::",
            at.map_or(" at the end checks".to_owned(), |i| format!(" at step {i}")),
            shrunk.len(),
            generated.nodes,
            generated.max_concurrent,
            generated.checkpoint_every_events,
            shown.join("\n"),
            ["ANIMA_SIM_STRICT", "ANIMA_SIM_TORN"]
                .iter()
                .filter_map(|name| std::env::var(name).ok().map(|v| format!(" {name}={v}")))
                .collect::<String>(),
        );
    }
    let elapsed = started.elapsed();
    eprintln!(
        "simulation: {} seeds × {steps} steps in {:.1} s ({:.1} seeds/s); known defects seen: {} heartbeats dropped, \
         {} wakes re-queued while heartbeating, {stuck_seeds} seeds with a stuck claim, {} held notices counting own rows, \
         {} sends allowed during a memory pass",
        seeds.len(),
        elapsed.as_secs_f64(),
        seeds.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        findings.heartbeats_dropped,
        findings.recovered_while_heartbeating,
        findings.held_counts_own_rows,
        findings.sends_during_memory_pass,
    );
    eprintln!(
        "simulation exercised: {exercised:?}; reopens that waited for sled's lock: {} polls",
        LOCK_RETRIES.load(std::sync::atomic::Ordering::Relaxed)
    );
}

// ---------------------------------------------------------------------------------------------
// The checker itself: it must fail on the violations it exists for, or the run above proves
// nothing.

fn dm_surface() -> SurfaceId {
    SurfaceId::Slack { team: TEAM.into(), channel: dm_channel(0).into(), thread_ts: None }
}

fn event(payload: Payload) -> proto::Envelope {
    proto::Envelope {
        event_id: "e".into(),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "checker-test".into(),
        payload: Some(payload),
    }
}

/// A person's DM to ada, journaled as row 1 and queued as a wake (the verdict is a real fold's,
/// so this input stays valid as verdicts grow fields).
fn model_with_a_foreign_dm_row() -> Model {
    let mut model = Model { max_concurrent: 1, ..Model::default() };
    let registration = event(Payload::AgentRegistered(proto::AgentRegistered {
        agent_id: AGENTS[0].into(),
        slack_bot_user_id: bot_user_id(0),
        ..Default::default()
    }));
    let message = event(Payload::SlackMessage(proto::SlackMessageObserved {
        receiving_agent_id: AGENTS[0].into(),
        kind: proto::SlackDeliveryKind::Message as i32,
        team_id: TEAM.into(),
        channel_id: dm_channel(0),
        ts: "1700000000.000001".into(),
        user_id: HUMANS[0].into(),
        text: "hello".into(),
        ..Default::default()
    }));
    let mut fold = anima_projections::State::new();
    fold.apply(anima_projections::LogPosition { seq: 1, at_ns: 1 }, &registration);
    fold.apply(anima_projections::LogPosition { seq: 2, at_ns: 2 }, &message);
    let journaled = fold.verdict(2).cloned();
    assert!(
        matches!(&journaled, Some(Verdict::Journaled(j)) if j.wake.is_some() && j.ordinal == 1),
        "the fold queues a person's DM: {journaled:?}"
    );
    model.apply(2, 2, &message, journaled.as_ref(), &BTreeMap::new()).expect("a plain DM is consistent");
    model
}

#[test]
fn the_checker_refuses_a_send_allowed_over_a_foreign_row_its_cursor_had_not_passed() {
    // Given ada's cursor at 0 on a DM whose row 1 is a person's.
    let mut model = model_with_a_foreign_dm_row();
    model.cursors.insert((AGENTS[0].into(), dm_surface()), 0);
    // When the fold allows ada's send there.
    let send = Payload::Send(Sim::send_request(0, &dm_surface()));
    let allowed =
        Verdict::Send(SendVerdict::Allowed { surface: dm_surface(), cursor_before: Some(0), cursor_after: Some(1) });
    let checked = model.apply(3, 3, &event(send), Some(&allowed), &BTreeMap::new());
    // Then the checker fails, naming the unsafe send.
    let error = checked.expect_err("an unsafe send must fail the check");
    assert!(error.contains("allowed over 1 foreign rows"), "{error}");
}

#[test]
fn the_checker_refuses_a_settled_item_that_comes_back() {
    // Given ada's DM wake settled without a turn at a claim (her cursor covers it).
    let mut model = model_with_a_foreign_dm_row();
    model.cursors.insert((AGENTS[0].into(), dm_surface()), 1);
    let id = format!("slack:{TEAM}:{}:1700000000.000001", dm_channel(0));
    let claim = Payload::WakeClaim(proto::WakeClaimRequested {
        agent_id: AGENTS[0].into(),
        worker_id: "w".into(),
        ..Default::default()
    });
    let nothing = Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn: vec![id.clone()] });
    model.apply(3, 3, &event(claim), Some(&nothing), &BTreeMap::new()).expect("a covered item settles");
    // When the fold queues the same item again a minute later.
    let item = ModelItem { id, trigger: None, resume: false, memory: None, session: None };
    let checked = model.enqueue(AGENTS[0], item, MINUTE_NS, 4);
    // Then the checker fails.
    let error = checked.expect_err("a settled item must not come back");
    assert!(error.contains("came back"), "{error}");
}

#[test]
fn the_checker_refuses_a_pass_over_max_concurrent() {
    // Given maxConcurrent 1 and ada's pass of 2026-03-02 queued at its slot.
    let mut model = Model { max_concurrent: 1, ..Model::default() };
    let slot_ms = 1_772_409_600_000 + 6 * 3_600_000;
    let pass = |agent: &str, seq: u64| {
        let request = Payload::MemoryPass(proto::MemoryPassRequested {
            agent_id: agent.into(),
            window_day: "2026-03-02".into(),
            slot_at_ms: slot_ms,
        });
        let queued = Verdict::MemoryPassQueued {
            agent: agent.into(),
            pass_id: format!("memory-pass:{agent}:2026-03-02"),
            window_day: "2026-03-02".into(),
        };
        (event(request), queued, seq)
    };
    let (request, queued, seq) = pass(AGENTS[0], 1);
    model.apply(seq, slot_ms * 1_000_000, &request, Some(&queued), &BTreeMap::new()).expect("the first pass fits");
    // When bo's pass is queued while ada's is still open.
    let (request, queued, seq) = pass(AGENTS[1], 2);
    let checked = model.apply(seq, slot_ms * 1_000_000 + 1, &request, Some(&queued), &BTreeMap::new());
    // Then the checker fails.
    let error = checked.expect_err("two open passes exceed maxConcurrent 1");
    assert!(error.contains("maxConcurrent is 1"), "{error}");
}
