//! Determinism and the send-hold guarantee under random interleavings.
//!
//! A scenario is a list of [`Action`]s (messages, redeliveries, edits, sends, confirmations,
//! claims, starts — fresh or repeated with an old plan —, finishes, re-registrations,
//! checkpoints). Running it folds each action's event through the test log and, after every
//! event, checks the fold against [`Model`]: an independent model built only from the raw events
//! and the design's rules (journals per surface with dedupe, ownership, cursors moved by accepted
//! starts and by send decisions). The model predicts every send verdict; in particular no send is
//! ever allowed over a foreign row between the agent's cursor and the send's position.
//!
//! Then: folding the same events again gives byte-identical state, and the changes drained at
//! checkpoints, replayed into a key-value store and loaded into a fresh `State`, reproduce it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use anima_projections::cold::{Cold, ColdStore};
use anima_projections::slot_page;

use anima_projections::journal::RECENT_ROWS_MAX;
use anima_projections::proto::{envelope::Payload, Envelope, WakeOutcome};
use anima_projections::verdict::{RefusalKind, SendVerdict, Verdict};
use anima_projections::State;
use proptest::prelude::*;

use crate::events::*;
use crate::log::TestLog;

const AGENTS: [&str; 2] = ["anna", "bert"];
const CHANNELS: [&str; 3] = ["D1", "D2", "C1"];
/// Mostly one worker per agent, sometimes a second one racing it.
const WORKERS: [&str; 4] = ["w1", "w1", "w1", "w2"];

/// Slack identities per agent; anna's registration alternates between two sets.
fn identities(agent: usize, variant: bool) -> (&'static str, &'static str) {
    match (agent, variant) {
        (0, false) => ("UANNA", "BANNA"),
        (0, true) => ("UANNA2", "BANNA2"),
        _ => ("UBERT", "BBERT"),
    }
}

#[derive(Clone, Copy, Debug)]
enum Author {
    Human(u8),
    /// An agent's bot user posting as a user.
    AgentUser(usize),
    /// An agent's bot (`bot_message` with its bot id).
    AgentBot(usize),
    /// A `bot_message` whose bot id is the agent's bot user id.
    AgentBotAsUser(usize),
    /// A bot of no agent.
    OtherBot,
}

#[derive(Clone, Debug)]
enum Action {
    /// A new message. `thread`: see [`Scenario::thread_ts`]. `jitter` puts its ts out of log
    /// order.
    Message {
        receiver: usize,
        channel: usize,
        thread: u8,
        author: Author,
        jitter: u8,
        file: bool,
    },
    /// An earlier message delivered again: to another agent's app, or as `app_mention`.
    Redeliver {
        which: usize,
        receiver: usize,
        mention: bool,
    },
    /// An edit of an earlier message: recorded, never a row.
    Edit {
        which: usize,
    },
    Send {
        agent: usize,
        channel: usize,
        thread: u8,
    },
    /// A send to the reply target of the agent's active wake (claimed or running), if any.
    Reply {
        agent: usize,
    },
    Confirm {
        agent: usize,
        channel: usize,
        thread: u8,
    },
    Claim {
        agent: usize,
        worker: usize,
    },
    /// Start with the active plan, as the claim prepared it; `worker` as in [`Scenario::worker`].
    Start {
        agent: usize,
        worker: usize,
    },
    /// An earlier start request appended again (a retry carrying an old plan).
    RepeatStart {
        which: usize,
    },
    /// `worker` as in [`Scenario::worker`].
    Finish {
        agent: usize,
        worker: usize,
        outcome: u8,
    },
    /// anna re-registers with her other set of identities.
    Reregister,
    /// The runner checkpoints the changed keys.
    Checkpoint,
}

fn author() -> impl Strategy<Value = Author> {
    prop_oneof![
        3 => (0..2u8).prop_map(Author::Human),
        1 => (0..2usize).prop_map(Author::AgentUser),
        1 => (0..2usize).prop_map(Author::AgentBot),
        1 => (0..2usize).prop_map(Author::AgentBotAsUser),
        1 => Just(Author::OtherBot),
    ]
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..2usize, 0..3usize, 0..6u8, author(), 0..3u8, any::<bool>()).prop_map(
            |(receiver, channel, thread, author, jitter, file)| Action::Message { receiver, channel, thread, author, jitter, file }
        ),
        1 => (any::<usize>(), 0..2usize, any::<bool>())
            .prop_map(|(which, receiver, mention)| Action::Redeliver { which, receiver, mention }),
        1 => any::<usize>().prop_map(|which| Action::Edit { which }),
        4 => (0..2usize, 0..3usize, 0..6u8).prop_map(|(agent, channel, thread)| Action::Send { agent, channel, thread }),
        2 => (0..2usize).prop_map(|agent| Action::Reply { agent }),
        1 => (0..2usize, 0..3usize, 0..6u8).prop_map(|(agent, channel, thread)| Action::Confirm { agent, channel, thread }),
        3 => (0..2usize, 0..4usize).prop_map(|(agent, worker)| Action::Claim { agent, worker }),
        3 => (0..2usize, 0..4usize).prop_map(|(agent, worker)| Action::Start { agent, worker }),
        1 => any::<usize>().prop_map(|which| Action::RepeatStart { which }),
        2 => (0..2usize, 0..4usize, 0..4u8).prop_map(|(agent, worker, outcome)| Action::Finish { agent, worker, outcome }),
        1 => Just(Action::Reregister),
        1 => Just(Action::Checkpoint),
    ]
}

/// Turns actions into events as they are folded (starts are resolved from state by the log).
#[derive(Default)]
struct Scenario {
    log: TestLog,
    model: Model,
    /// The checkpoint store: the runner's key-value view of the state.
    checkpoint: Arc<MemoryStore>,
    /// Set: after every event the changes are checkpointed and every clean entry of the cold
    /// tables leaves memory, so each decision reads what it needs back from the store.
    evict_always: bool,
    messages: Vec<Envelope>,
    starts: Vec<Envelope>,
    /// Top-level message ts per channel, newest last.
    top_level: BTreeMap<&'static str, Vec<String>>,
    messages_made: u64,
    anna_variant: bool,
}

/// A key-value checkpoint store in memory, readable as the fold's cold store; it counts the
/// reads of each table.
#[derive(Default)]
struct MemoryStore(Mutex<BTreeMap<Vec<u8>, Vec<u8>>>, Mutex<BTreeMap<&'static str, u64>>);

impl MemoryStore {
    fn entries(&self) -> BTreeMap<Vec<u8>, Vec<u8>> {
        self.0.lock().unwrap().clone()
    }
}

impl ColdStore for MemoryStore {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, String> {
        let table = key.first().and_then(|tag| State::table_of_tag(*tag)).unwrap_or("?");
        *self.1.lock().unwrap().entry(table).or_default() += 1;
        Ok(self.0.lock().unwrap().get(key).cloned())
    }

    fn scan(&self, prefix: &[u8]) -> Result<anima_projections::cold::Entries, String> {
        let entries = self.0.lock().unwrap();
        Ok(entries
            .range(prefix.to_vec()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }

    /// One read, as the checkpoint store reads a slot page: the stored entries (kept one by one
    /// here) that fall in `key`'s page.
    fn get_page(&self, key: &[u8]) -> Result<anima_projections::cold::Entries, String> {
        let Some(page) = slot_page::paged_key(key) else {
            return Ok(self.get(key)?.map(|value| vec![(key.to_vec(), value)]).unwrap_or_default());
        };
        let table = key.first().and_then(|tag| State::table_of_tag(*tag)).unwrap_or("?");
        *self.1.lock().unwrap().entry(table).or_default() += 1;
        let entries = self.0.lock().unwrap();
        Ok(entries
            .range(key[..1].to_vec()..)
            .take_while(|(k, _)| k.first() == key.first())
            .filter(|(k, _)| slot_page::paged_key(k).is_some_and(|other| other.page_key == page.page_key))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect())
    }
}

impl Scenario {
    /// A scenario whose state keeps nothing cold in memory (see `Scenario::evict_always`).
    /// `restored`: the state is backed as a restored one is, reading every key it does not
    /// hold from the store; otherwise it started empty and counts what it let go of, reading
    /// only keys that may have left memory (see `ColdTable`).
    fn evicting(restored: bool) -> Self {
        let mut scenario = Scenario { evict_always: true, ..Scenario::default() };
        let store: Arc<dyn ColdStore> = scenario.checkpoint.clone();
        scenario.log.state.attach_cold(Cold::new(store), restored);
        scenario.register_agents();
        scenario
    }

    fn new() -> Self {
        let mut scenario = Scenario::default();
        scenario.register_agents();
        scenario
    }

    fn register_agents(&mut self) {
        let scenario = self;
        for (index, name) in AGENTS.iter().enumerate() {
            let (user, bot) = identities(index, false);
            scenario.fold(agent(name, user, bot));
        }
    }

    /// A fresh ts: unique, and out of log order by `jitter` thousand minutes.
    fn fresh_ts(&mut self, jitter: u8) -> String {
        self.messages_made += 1;
        assert!(self.messages_made < 1_000, "ts stay unique below 1,000 messages");
        ts(self.messages_made + 1_000 * u64::from(jitter))
    }

    /// `thread` 0..=3: the top level (most messages are); 4 or 5: the thread of the newest or
    /// second newest top-level message of the channel.
    fn thread_ts(&self, channel: &'static str, thread: u8) -> Option<String> {
        let parents = self.top_level.get(channel)?;
        let k = usize::from(thread.checked_sub(3)?);
        (k > 0 && k <= parents.len()).then(|| parents[parents.len() - k].clone())
    }

    fn agent_ids(&self, agent: usize) -> (&'static str, &'static str) {
        identities(agent, agent == 0 && self.anna_variant)
    }

    /// The worker of a start or finish: mostly the one holding the agent's active wake (as a
    /// runtime would), sometimes `w2`, which may hold nothing.
    fn worker(&self, agent: usize, worker: usize) -> String {
        let active = self.log.state.queue(AGENTS[agent]).and_then(|q| q.active.as_ref());
        match active {
            Some(active) if worker < 3 => active.worker.clone(),
            _ => WORKERS[worker].to_owned(),
        }
    }

    fn act(&mut self, action: &Action) {
        match action {
            Action::Message { receiver, channel, thread, author, jitter, file } => {
                let channel = CHANNELS[*channel];
                let ts = self.fresh_ts(*jitter);
                let mut event = message(AGENTS[*receiver], channel, &ts);
                event = match *author {
                    Author::Human(n) => event.by_user(&format!("U{n}"), "Human"),
                    Author::AgentUser(a) => event.by_user(self.agent_ids(a).0, AGENTS[a]),
                    Author::AgentBot(a) => event.by_bot(self.agent_ids(a).1, AGENTS[a]),
                    Author::AgentBotAsUser(a) => event.by_bot(self.agent_ids(a).0, AGENTS[a]),
                    Author::OtherBot => event.by_bot("BCI", "ci"),
                };
                event = event.text(&format!("message {}", self.messages_made));
                if *file {
                    event = event.file("notes.txt", 10);
                }
                match self.thread_ts(channel, *thread) {
                    Some(parent) => event = event.in_thread(&parent),
                    None => self.top_level.entry(channel).or_default().push(ts),
                }
                self.messages.push(event.clone());
                self.fold(event);
            }
            Action::Redeliver { which, receiver, mention } => {
                if self.messages.is_empty() {
                    return;
                }
                let mut event = self.messages[which % self.messages.len()].clone().delivered_to(AGENTS[*receiver]);
                if *mention {
                    event = event.app_mention();
                }
                self.fold(event);
            }
            Action::Edit { which } => {
                if self.messages.is_empty() {
                    return;
                }
                let event =
                    self.messages[which % self.messages.len()].clone().subtype("message_changed").text("edited");
                self.fold(event);
            }
            Action::Send { agent, channel, thread } => {
                let channel = CHANNELS[*channel];
                let mut event = send(AGENTS[*agent], channel);
                if let Some(parent) = self.thread_ts(channel, *thread) {
                    event = event.in_thread(&parent);
                }
                self.fold(event);
            }
            Action::Reply { agent } => {
                let active = self.log.state.queue(AGENTS[*agent]).and_then(|q| q.active.as_ref());
                if let Some(active) = active {
                    let target = active.item.reply_to.to_target();
                    let mut event = send(AGENTS[*agent], "-");
                    if let Some(Payload::Send(s)) = event.payload.as_mut() {
                        s.target = Some(target);
                    }
                    self.fold(event);
                }
            }
            Action::Confirm { agent, channel, thread } => {
                let channel = CHANNELS[*channel];
                let ts = self.fresh_ts(0);
                let mut event = confirmed(AGENTS[*agent], channel, &ts, "posted");
                match self.thread_ts(channel, *thread) {
                    Some(parent) => event = event.in_thread(&parent),
                    None => self.top_level.entry(channel).or_default().push(ts),
                }
                self.fold(event);
            }
            Action::Claim { agent, worker } => {
                self.fold(claim(AGENTS[*agent], WORKERS[*worker]));
            }
            Action::Start { agent, worker } => {
                let worker = self.worker(*agent, *worker);
                let seq = self.fold(start(AGENTS[*agent], &worker));
                self.starts.push(self.log.events[seq as usize - 1].clone());
            }
            Action::RepeatStart { which } => {
                if !self.starts.is_empty() {
                    self.fold(self.starts[which % self.starts.len()].clone());
                }
            }
            Action::Finish { agent, worker, outcome } => {
                let worker = self.worker(*agent, *worker);
                let (agent, worker) = (AGENTS[*agent], worker.as_str());
                let event = match outcome {
                    0 => finish(agent, worker, WakeOutcome::Completed),
                    1 => finish(agent, worker, WakeOutcome::Failed),
                    2 => finish(agent, worker, WakeOutcome::Aborted),
                    _ => restart_drain(agent, worker),
                };
                self.fold(event);
            }
            Action::Reregister => {
                self.anna_variant = !self.anna_variant;
                let (user, bot) = self.agent_ids(0);
                self.fold(agent("anna", user, bot));
            }
            Action::Checkpoint => self.checkpoint(),
        }
    }

    fn fold(&mut self, event: Envelope) -> u64 {
        let seq = self.log.fold(event);
        let event = &self.log.events[seq as usize - 1];
        self.model.check(event, &self.log.state, seq);
        if self.evict_always {
            self.checkpoint();
            self.log.state.evict_cold(usize::MAX);
        }
        seq
    }

    /// Writes the changed keys into the checkpoint store, as the runner does.
    fn checkpoint(&mut self) {
        write_entries(&mut self.checkpoint.0.lock().unwrap(), self.log.state.drain_changes());
    }

    /// Checks determinism and the checkpoint round trip of everything folded so far.
    fn check_replays(&mut self) {
        let bytes = self.log.state.canonical_bytes();
        let mut again = State::new();
        for (at, event) in self.log.positions.iter().zip(&self.log.events) {
            again.apply(*at, event);
        }
        assert!(again.canonical_bytes() == bytes, "folding the same events again gave different state");
        self.checkpoint();
        let loaded = load_entries(&self.checkpoint.entries());
        assert!(loaded.canonical_bytes() == bytes, "state loaded from the checkpoint differs from the folded state");
        // A restart loads each table's entries at once (`State::load_table_entries`).
        let by_table = load_tables(&self.checkpoint.entries());
        assert!(by_table == loaded, "a checkpoint loaded table by table differs from one loaded entry by entry");
        // Derived lookup indexes (interned keys, queued ids) are not in the canonical bytes:
        // loading must rebuild them too.
        if !self.evict_always {
            assert!(loaded == self.log.state, "indexes rebuilt from the checkpoint differ from the folded state's");
        }
    }
}

/// The design's rules, applied to the raw events: journals, ownership, cursors, send verdicts.
#[derive(Default)]
struct Model {
    /// Agent → (bot user id, bot id), as registered.
    agents: BTreeMap<String, (String, String)>,
    /// Surface key → owner of each row (`rows[ordinal - 1]`).
    rows: BTreeMap<String, Vec<Option<String>>>,
    /// (surface key, ts) of every row: one row per message.
    identities: BTreeMap<(String, String), u64>,
    /// (agent, surface key) → rows 1..=N delivered.
    cursors: BTreeMap<(String, String), u64>,
}

fn surface_key(channel: &str, ts: &str, thread_ts: &str) -> String {
    let thread = thread_ts.trim();
    if thread.is_empty() || thread == ts {
        format!("slack:{TEAM}:{channel}")
    } else {
        format!("slack:{TEAM}:{channel}:thread:{thread}")
    }
}

impl Model {
    fn owner(&self, user_id: &str, bot_id: &str) -> Option<String> {
        self.agents
            .iter()
            .find(|(_, (user, bot))| {
                (!user_id.is_empty() && user_id == user) || (!bot_id.is_empty() && (bot_id == bot || bot_id == user))
            })
            .map(|(agent, _)| agent.clone())
    }

    fn journal(&mut self, surface: String, ts: &str, owner: Option<String>) {
        if self.identities.contains_key(&(surface.clone(), ts.to_owned())) {
            return;
        }
        let rows = self.rows.entry(surface.clone()).or_default();
        rows.push(owner);
        self.identities.insert((surface, ts.to_owned()), rows.len() as u64);
    }

    fn tail(&self, surface: &str) -> u64 {
        self.rows.get(surface).map_or(0, |rows| rows.len() as u64)
    }

    fn move_cursor(&mut self, agent: &str, surface: &str, to: u64) {
        let key = (agent.to_owned(), surface.to_owned());
        let from = self.cursors.get(&key).copied();
        assert!(
            from.is_none_or(|from| from <= to),
            "cursor of {agent} on {surface} would move back from {from:?} to {to}"
        );
        assert!(to <= self.tail(surface), "cursor of {agent} on {surface} would pass the tail");
        self.cursors.insert(key, to);
    }

    /// Applies the event at `seq` to the model and checks the fold's verdict and cursors.
    fn check(&mut self, event: &Envelope, state: &State, seq: u64) {
        let verdict = state.verdict(seq);
        match event.payload.as_ref() {
            Some(Payload::AgentRegistered(r)) => {
                self.agents.insert(r.agent_id.clone(), (r.slack_bot_user_id.clone(), r.slack_bot_id.clone()));
            }
            // The generator makes only valid, observable messages, besides edits.
            Some(Payload::SlackMessage(m)) if m.subtype != "message_changed" => {
                let owner = self.owner(&m.user_id, &m.bot_id);
                self.journal(surface_key(&m.channel_id, &m.ts, &m.thread_ts), &m.ts, owner);
            }
            Some(Payload::SendConfirmed(c)) => {
                let Some(anima_projections::proto::ReplyTarget {
                    target: Some(anima_projections::proto::reply_target::Target::Slack(t)),
                }) = &c.target
                else {
                    unreachable!("the generator always targets Slack")
                };
                let surface = if t.thread_ts.is_empty() {
                    format!("slack:{TEAM}:{}", t.channel_id)
                } else {
                    format!("slack:{TEAM}:{}:thread:{}", t.channel_id, t.thread_ts)
                };
                self.journal(surface, &c.ts, Some(c.agent_id.clone()));
            }
            Some(Payload::Send(s)) => self.check_send(s, verdict),
            Some(Payload::WakeStart(s)) => self.check_start(s, verdict),
            _ => {}
        }
        let folded: BTreeMap<(String, String), u64> = state
            .cursor_entries()
            .into_iter()
            .map(|((agent, surface), n)| ((agent.to_owned(), surface.to_string()), n))
            .collect();
        assert_eq!(folded, self.cursors, "cursors after seq {seq}");
        for (surface, journal) in state.journal_entries() {
            assert_eq!(journal.tail, self.tail(&surface.to_string()), "tail of {surface} after seq {seq}");
        }
    }

    fn check_send(&mut self, request: &anima_projections::proto::SendRequested, verdict: Option<&Verdict>) {
        let Some(anima_projections::proto::ReplyTarget {
            target: Some(anima_projections::proto::reply_target::Target::Slack(t)),
        }) = &request.target
        else {
            unreachable!("the generator always targets Slack")
        };
        let surface = if t.thread_ts.is_empty() {
            format!("slack:{TEAM}:{}", t.channel_id)
        } else {
            format!("slack:{TEAM}:{}:thread:{}", t.channel_id, t.thread_ts)
        };
        let agent = request.agent_id.as_str();
        let cursor = self.cursors.get(&(agent.to_owned(), surface.clone())).copied();
        let tail = self.tail(&surface);
        let foreign_after_cursor = cursor.is_some_and(|c| {
            self.rows.get(&surface).is_some_and(|rows| {
                rows[usize::try_from(c).unwrap()..].iter().any(|owner| owner.as_deref() != Some(agent))
            })
        });
        match verdict {
            Some(Verdict::Send(SendVerdict::Allowed { cursor_before, cursor_after, .. })) => {
                // The guarantee: never allowed over a foreign row between the cursor and the send.
                assert!(
                    !foreign_after_cursor,
                    "{agent}'s send to {surface} was allowed over a foreign row after cursor {cursor:?}"
                );
                assert_eq!(*cursor_before, cursor);
                assert_eq!(*cursor_after, cursor.map(|_| tail));
                if cursor.is_some() {
                    self.move_cursor(agent, &surface, tail);
                }
            }
            Some(Verdict::Send(SendVerdict::Held(held))) => {
                assert!(
                    foreign_after_cursor,
                    "{agent}'s send to {surface} was held with no foreign row after {cursor:?}"
                );
                // Only foreign rows are new; rows older than the fold's window of recent rows
                // cannot be told apart any more and count as new.
                let after_cursor = cursor.unwrap();
                let window_first = tail.saturating_sub(RECENT_ROWS_MAX as u64) + 1;
                let owners = &self.rows[&surface];
                let foreign_in_window: Vec<u64> = (after_cursor.max(window_first - 1) + 1..=tail)
                    .filter(|ordinal| owners[usize::try_from(*ordinal - 1).unwrap()].as_deref() != Some(agent))
                    .collect();
                let new_messages = window_first.saturating_sub(after_cursor + 1) + foreign_in_window.len() as u64;
                assert_eq!((Some(held.cursor_before), held.tail, held.new_messages), (cursor, tail, new_messages));
                let shown: Vec<u64> = held.shown.iter().map(|r| r.ordinal).collect();
                let expected = &foreign_in_window[foreign_in_window.len() - shown.len()..];
                assert_eq!(shown, expected, "a hold shows the newest foreign rows, oldest first");
                assert_eq!(held.omitted + shown.len() as u64, held.new_messages);
                self.move_cursor(agent, &surface, tail);
            }
            other => panic!("a valid send was not decided: {other:?}"),
        }
    }

    fn check_start(&mut self, request: &anima_projections::proto::WakeStartRequested, verdict: Option<&Verdict>) {
        let agent = request.agent_id.as_str();
        let cursor = |model: &Model, surface: &str| model.cursors.get(&(agent.to_owned(), surface.to_owned())).copied();
        let expected = |p: &anima_projections::proto::PlanSurface| p.expected_present.then_some(p.expected_ordinal);
        match verdict {
            Some(Verdict::Started { .. }) => {
                for p in &request.plan {
                    assert_eq!(cursor(self, &p.surface), expected(p), "a start was accepted with a stale plan");
                }
                for p in &request.plan {
                    let to = cursor(self, &p.surface).unwrap_or(0).max(p.target_ordinal);
                    self.move_cursor(agent, &p.surface, to);
                }
            }
            // A start from a worker that does not hold the claim (never had it, or lost it) is
            // refused as ABORTED too: claim again.
            Some(Verdict::Refused(refusal))
                if refusal.kind == RefusalKind::Aborted && refusal.message.contains("not claimed by this worker") => {}
            Some(Verdict::Refused(refusal)) if refusal.kind == RefusalKind::Aborted => {
                assert!(
                    request.plan.iter().any(|p| cursor(self, &p.surface) != expected(p)),
                    "a start was refused as stale with a fresh plan: {}",
                    refusal.message
                );
            }
            Some(Verdict::Refused(_)) => {}
            other => panic!("a start was not decided: {other:?}"),
        }
    }
}

fn run(actions: &[Action]) -> Scenario {
    let mut scenario = Scenario::new();
    for action in actions {
        scenario.act(action);
    }
    scenario.check_replays();
    scenario
}

/// Runs `actions` twice, keeping everything in memory and keeping nothing cold in memory: every
/// verdict and the canonical state must be the same (a verdict never depends on memory).
fn run_with_and_without_eviction(actions: &[Action]) {
    let kept = run(actions);
    for restored in [false, true] {
        let mut evicting = Scenario::evicting(restored);
        for action in actions {
            evicting.act(action);
        }
        evicting.check_replays();
        assert_eq!(kept.log.events.len(), evicting.log.events.len());
        for seq in 1..=kept.log.events.len() as u64 {
            assert_eq!(
                kept.log.state.verdict(seq),
                evicting.log.state.verdict(seq),
                "the verdict of seq {seq} depends on what was in memory (restored: {restored})"
            );
        }
        assert!(
            kept.log.state.canonical_bytes() == evicting.log.state.canonical_bytes(),
            "the state folded with eviction differs from the one folded without (restored: {restored})"
        );
        assert_eq!(evicting.log.state.cold_resident_len(), 0, "nothing cold stayed in memory");
    }
}

/// Writes checkpoint entries into a store as the runner does (`None` removes the key).
fn write_entries(store: &mut BTreeMap<Vec<u8>, Vec<u8>>, entries: anima_projections::changes::EncodedChanges) {
    for (key, value) in entries {
        match value {
            Some(value) => store.insert(key, value),
            None => store.remove(&key),
        };
    }
}

/// A state loaded from every entry of a checkpoint store.
fn load_entries(store: &BTreeMap<Vec<u8>, Vec<u8>>) -> State {
    let mut loaded = State::new();
    for (key, value) in store {
        loaded.load_entry(key, value).expect("checkpoint entries decode");
    }
    loaded
}

/// A state loaded from a checkpoint store table by table, as a restart loads it.
fn load_tables(store: &BTreeMap<Vec<u8>, Vec<u8>>) -> State {
    let mut loaded = State::new();
    let mut tags: Vec<u8> = store.keys().map(|key| key[0]).collect();
    tags.dedup();
    for tag in tags {
        let entries: Vec<(&Vec<u8>, &Vec<u8>)> = store.iter().filter(|(key, _)| key[0] == tag).collect();
        loaded.load_table_entries(tag, &entries).expect("checkpoint entries decode");
    }
    loaded
}

/// A checkpoint's changes are taken between two fold batches and encoded later, beside the fold,
/// which goes on changing the same keys meanwhile (queued wakes taken, verdicts, rows, cursors).
/// What gets written must be the state as of the take: restored, it equals the state folded up
/// to that point, whatever the fold did after it.
fn a_checkpoint_encoded_later_holds_the_state_it_was_taken_from(actions: &[Action], split: usize) {
    let split = split.min(actions.len());
    let mut scenario = Scenario::new();
    for action in &actions[..split] {
        scenario.act(action);
    }
    let taken = scenario.log.state.take_changes();
    let expected = scenario.log.state.canonical_bytes();
    for action in actions[split..].iter().filter(|action| !matches!(action, Action::Checkpoint)) {
        scenario.act(action);
    }
    let mut store = scenario.checkpoint.entries();
    write_entries(&mut store, taken.encode());
    let loaded = load_entries(&store);
    assert!(
        loaded.canonical_bytes() == expected,
        "a checkpoint encoded after the fold moved on differs from the state it was taken from"
    );
}

proptest! {
    #[test]
    fn checkpoints_encoded_beside_the_fold_hold_the_state_they_were_taken_from(
        actions in prop::collection::vec(action(), 1..150),
        split in 0usize..150,
    ) {
        a_checkpoint_encoded_later_holds_the_state_it_was_taken_from(&actions, split);
    }

    #[test]
    fn random_interleavings_match_the_model_and_replay_identically(actions in prop::collection::vec(action(), 1..150)) {
        run(&actions);
    }

    #[test]
    fn verdicts_do_not_depend_on_what_was_in_memory(actions in prop::collection::vec(action(), 1..150)) {
        run_with_and_without_eviction(&actions);
    }
}

/// A small seeded generator (SplitMix64) for the long scenarios; a failing seed is named in the
/// assertion message.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> usize {
        usize::try_from(self.next() % n).unwrap()
    }

    fn action(&mut self) -> Action {
        let index = |r: &mut SplitMix| r.next() as usize;
        let author = match self.below(7) {
            0..=2 => Author::Human(self.below(2) as u8),
            3 => Author::AgentUser(self.below(2)),
            4 => Author::AgentBot(self.below(2)),
            5 => Author::AgentBotAsUser(self.below(2)),
            _ => Author::OtherBot,
        };
        match self.below(27) {
            0..=5 => Action::Message {
                receiver: self.below(2),
                channel: self.below(3),
                thread: self.below(6) as u8,
                author,
                jitter: self.below(3) as u8,
                file: self.below(2) == 0,
            },
            6 => Action::Redeliver { which: index(self), receiver: self.below(2), mention: self.below(2) == 0 },
            7 => Action::Edit { which: index(self) },
            8..=11 => Action::Send { agent: self.below(2), channel: self.below(3), thread: self.below(6) as u8 },
            12 => Action::Confirm { agent: self.below(2), channel: self.below(3), thread: self.below(6) as u8 },
            13..=15 => Action::Claim { agent: self.below(2), worker: self.below(4) },
            16..=18 => Action::Start { agent: self.below(2), worker: self.below(4) },
            19 => Action::RepeatStart { which: index(self) },
            20 | 21 => Action::Finish { agent: self.below(2), worker: self.below(4), outcome: self.below(4) as u8 },
            22 => Action::Reregister,
            23 | 24 => Action::Reply { agent: self.below(2) },
            _ => Action::Checkpoint,
        }
    }
}

#[test]
fn a_long_generated_scenario_folds_identically_twice() {
    for seed in [1_u64, 2, 3] {
        let mut random = SplitMix(seed);
        let actions: Vec<Action> = (0..2_000).map(|_| random.action()).collect();
        let scenario = std::panic::catch_unwind(|| run(&actions));
        assert!(scenario.is_ok(), "the scenario of seed {seed} failed");
        let evicting = std::panic::catch_unwind(|| run_with_and_without_eviction(&actions));
        assert!(evicting.is_ok(), "the scenario of seed {seed} decided differently with nothing cold in memory");
    }
}

#[test]
fn the_checkpoint_round_trip_survives_removals() {
    // Identity eviction beyond the per-surface window, and identities dropped by a
    // re-registration, both remove keys; the verdict window drops the oldest verdicts.
    let mut scenario = Scenario::new();
    for n in 0..5_100_u64 {
        let event = message("anna", "C1", &format!("{}.000100", 1_600_000_000 + n)).by_user("U1", "Uma").text("x");
        scenario.log.fold(event);
        if n % 1_000 == 0 {
            scenario.checkpoint();
        }
    }
    scenario.log.fold(agent("anna", "UANNA2", "BANNA2"));
    scenario.checkpoint();
    scenario.log.fold(agent("anna", "UANNA", "BANNA"));
    let kept = anima_projections::state::VERDICTS_KEPT_MAX as u64;
    while (scenario.log.events.len() as u64) < kept + 100 {
        scenario.log.fold(send("bert", "C1"));
    }
    assert_eq!(scenario.log.state.verdicts.len() as u64, kept);
    assert_eq!(
        scenario.log.state.identities.resident_len() as u64,
        anima_projections::state::IDENTITIES_PER_SURFACE_MAX
    );
    scenario.check_replays();
}

#[test]
fn identities_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory() {
    identities_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(false);
    identities_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(true);
}

/// `restored`: see [`Scenario::evicting`].
fn identities_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(restored: bool) {
    // The dedupe window's oldest identity is forgotten through the cold store when it left
    // memory; a redelivery of an old message is then new again in both folds, of a recent one
    // a duplicate in both.
    let mut kept = Scenario::new();
    let mut evicting = Scenario::evicting(restored);
    let total = anima_projections::state::IDENTITIES_PER_SURFACE_MAX + 50;
    let event = |n: u64| message("anna", "C1", &format!("{}.000100", 1_600_000_000 + n)).by_user("U1", "Uma").text("x");
    // The model does not know the window, so these folds go around it.
    let mut both = |envelope: Envelope| {
        kept.log.fold(envelope.clone());
        evicting.log.fold(envelope);
        evicting.checkpoint();
        evicting.log.state.evict_cold(usize::MAX);
    };
    for n in 0..total {
        both(event(n));
    }
    for n in [0, 10, total - 1] {
        both(event(n));
    }
    let tail = |state: &State| state.journal_entries()[0].1.tail;
    assert_eq!(tail(&kept.log.state), total + 2, "two redeliveries were beyond the window, one within");
    for seq in 1..=kept.log.events.len() as u64 {
        assert_eq!(kept.log.state.verdict(seq), evicting.log.state.verdict(seq), "verdict of seq {seq}");
    }
    assert!(kept.log.state.canonical_bytes() == evicting.log.state.canonical_bytes());
    assert_eq!(evicting.log.state.cold_resident_len(), 0, "nothing cold stayed in memory");
}

/// Every mention starts a thread its agent follows, so the subscriptions grow with the history
/// and leave memory under the budget like the other cold tables. A thread followed long ago
/// still wakes its follower, and the agent's list still shows every thread, read back from the
/// store; verdicts and state are those of a fold that kept everything.
#[test]
fn subscriptions_that_left_memory_still_route_and_are_listed() {
    use anima_projections::subscription::Route;
    use anima_projections::wake::WakeReason;
    for restored in [false, true] {
        let mut kept = Scenario::new();
        let mut evicting = Scenario::evicting(restored);
        let (bot_user, _) = identities(0, false);
        let mention = |n: u64| message("anna", "C1", &ts(n)).by_user("U1", "Uma").text(&format!("<@{bot_user}> look"));
        for n in 0..40 {
            kept.log.fold(mention(n));
            evicting.log.fold(mention(n));
            evicting.checkpoint();
            evicting.log.state.evict_cold(usize::MAX);
        }
        assert_eq!(evicting.log.state.subscriptions.resident_len(), 0, "the subscriptions left memory");
        let listed = kept.log.state.subscriptions_of("anna");
        assert_eq!(listed.len(), 41, "the channel and the 40 threads: {listed:?}");
        assert_eq!(evicting.log.state.subscriptions_of("anna"), listed, "listed from the store alike");
        // A reply in the first thread, followed 40 mentions ago: a follow wake in both folds.
        let reply = message("anna", "C1", &ts(100)).by_user("U1", "Uma").text("and this").in_thread(&ts(0));
        kept.log.fold(reply.clone());
        let seq = evicting.log.fold(reply);
        let route = match evicting.log.state.verdict(seq) {
            Some(Verdict::Journaled(journaled)) => journaled.route,
            other => panic!("not journaled: {other:?}"),
        };
        assert_eq!(route, Some(Route::Wake(WakeReason::ThreadFollow)), "restored: {restored}");
        for seq in 1..=kept.log.events.len() as u64 {
            assert_eq!(kept.log.state.verdict(seq), evicting.log.state.verdict(seq), "verdict of seq {seq}");
        }
        assert!(kept.log.state.canonical_bytes() == evicting.log.state.canonical_bytes());
    }
}

/// `Subscriptions.List` reads a page's stored entries and surface names without the state's
/// lock: memory is looked at under the lock (`begin`), the store after it (`read_store`), and
/// the page is finished under the lock again (`end`). The page is the state as it was when the
/// page began, even when the fold changed an entry in memory meanwhile; and when a checkpoint
/// was taken meanwhile (it may have written a newer value of an entry read from the store), the
/// page is refused so that the reader begins again, never a page of two states.
#[test]
fn a_page_read_without_the_state_is_the_state_at_its_beginning_or_refused() {
    let thread_zero_muted = |page: &anima_projections::subscription::SubscriptionsPage| {
        let zero = ts(0);
        page.0.iter().find(|(surface, _)| surface.thread_ts() == Some(zero.as_str())).expect("thread 0 listed").1.muted
    };
    for restored in [false, true] {
        let mut evicting = Scenario::evicting(restored);
        let (bot_user, _) = identities(0, false);
        for n in 0..40 {
            let mention = message("anna", "C1", &ts(n)).by_user("U1", "Uma").text(&format!("<@{bot_user}> look"));
            evicting.log.fold(mention);
            evicting.checkpoint();
            evicting.log.state.evict_cold(usize::MAX);
        }
        assert_eq!(evicting.log.state.subscriptions.resident_len(), 0, "the subscriptions left memory");
        let before = evicting.log.state.subscriptions_page("anna", None, 100).unwrap();
        assert_eq!(before.0.len(), 41, "the channel and the 40 threads");
        assert!(!thread_zero_muted(&before));

        // Muted while the page is read, no checkpoint between: the page as it began.
        let mut read = evicting.log.state.subscriptions_page_begin("anna", None, 100).unwrap();
        evicting.log.fold(mute("anna", "C1", Some(&ts(0)), true));
        read.read_store();
        let page = evicting.log.state.subscriptions_page_end(read).expect("no checkpoint was taken");
        assert_eq!(page, before, "restored: {restored}");
        let muted = evicting.log.state.subscriptions_page("anna", None, 100).unwrap();
        assert!(thread_zero_muted(&muted), "the next page shows the mute");

        // With the mute only in the store, unmuted and checkpointed while the page is read:
        // the store read the unmute, which the state at the page's beginning did not have.
        evicting.checkpoint();
        evicting.log.state.evict_cold(usize::MAX);
        let mut read = evicting.log.state.subscriptions_page_begin("anna", None, 100).unwrap();
        evicting.log.fold(mute("anna", "C1", Some(&ts(0)), false));
        evicting.checkpoint();
        read.read_store();
        assert!(evicting.log.state.subscriptions_page_end(read).is_none(), "a checkpoint was taken: begin again");
        let again = evicting.log.state.subscriptions_page("anna", None, 100).unwrap();
        assert!(!thread_zero_muted(&again), "begun again: the unmute");
    }
}

/// Surfaces grow with the history (every DM and every thread is one), and what the fold keeps
/// of each — its interned key both ways, its journal header, the cursors on it — leaves memory
/// under the budget like the other cold tables, read back from the store when a decision needs
/// it. An agent answering in a DM it last looked at 40 conversations ago is held over the one
/// message it missed, and one answering where nothing moved is allowed, exactly as in a fold
/// that kept everything (started empty, and restored).
#[test]
fn surfaces_journals_and_cursors_that_left_memory_still_decide_sends() {
    for restored in [false, true] {
        let mut kept = Scenario::new();
        let mut evicting = [Scenario::evicting(restored)];
        for n in 0..40u64 {
            let dm = format!("D{n}");
            let woken = [
                dm_from_human("anna", &dm, &ts(n), "hello"),
                claim("anna", "w1"),
                start("anna", "w1"),
                finish("anna", "w1", WakeOutcome::Completed),
            ];
            for event in woken {
                fold_all(&mut kept, &mut evicting, event, true);
            }
        }
        let state = &evicting[0].log.state;
        let resident = [
            state.surface_keys.resident_len(),
            state.surface_ids.resident_len(),
            state.journals.resident_len(),
            state.cursors.resident_len(),
        ];
        assert_eq!(resident, [0; 4], "keys, surfaces, journals and cursors left memory (restored: {restored})");
        assert_eq!(state.cold_resident_len(), 0, "nothing cold stayed in memory");
        assert_eq!((state.surfaces_len(), state.journals_len(), state.cursors_len()), (40, 40, 40));
        fold_all(&mut kept, &mut evicting, dm_from_human("anna", "D0", &ts(100), "are you there?"), true);
        let held = fold_all(&mut kept, &mut evicting, send("anna", "D0"), true);
        let allowed = fold_all(&mut kept, &mut evicting, send("anna", "D1"), true);
        match evicting[0].log.state.verdict(held) {
            Some(Verdict::Send(SendVerdict::Held(held))) => {
                assert_eq!((held.cursor_before, held.tail, held.new_messages), (1, 2, 1), "{held:?}")
            }
            other => panic!("the send into D0 is not held: {other:?}"),
        }
        let allowed = evicting[0].log.state.verdict(allowed);
        assert!(matches!(allowed, Some(Verdict::Send(SendVerdict::Allowed { .. }))), "{allowed:?}");
        assert_same_as_kept(&kept, &evicting);
    }
}

/// A Linear session event for anna: `created`, session `n`.
fn linear_created(n: u64, again: &str) -> Envelope {
    use anima_projections::proto::{LinearSessionEvent, LinearSessionEventKind};
    Envelope {
        event_id: format!("linear:{n}{again}"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearSession(LinearSessionEvent {
            receiving_agent_id: "anna".to_owned(),
            installation_id: "inst1".to_owned(),
            kind: LinearSessionEventKind::Created as i32,
            session_id: format!("00000000-0000-4000-8000-{n:012}"),
            agent_activity_id: String::new(),
            issue_identifier: "ENG-42".to_owned(),
            issue_url: "https://linear.app/acme/issue/ENG-42".to_owned(),
            issue_title: "Flaky login test".to_owned(),
            prompt_text: "Look.".to_owned(),
        })),
    }
}

/// Folds `event` into `kept` and into each of `evicting`, which then checkpoint and let go of
/// every clean cold entry when `evict`; returns its seq.
fn fold_all(kept: &mut Scenario, evicting: &mut [Scenario], event: Envelope, evict: bool) -> u64 {
    for scenario in evicting.iter_mut() {
        scenario.log.fold(event.clone());
        if evict {
            scenario.checkpoint();
            scenario.log.state.evict_cold(usize::MAX);
        }
    }
    kept.log.fold(event)
}

/// Every verdict and the state of each of `evicting` are those of `kept`.
fn assert_same_as_kept(kept: &Scenario, evicting: &[Scenario]) {
    for scenario in evicting {
        for seq in 1..=kept.log.events.len() as u64 {
            assert_eq!(kept.log.state.verdict(seq), scenario.log.state.verdict(seq), "verdict of seq {seq}");
        }
        assert!(kept.log.state.canonical_bytes() == scenario.log.state.canonical_bytes());
    }
}

/// The window of Linear receipts (first receipt wins) is cold: its oldest receipt is forgotten
/// through the store when it left memory. A redelivery of a receipt pushed out of the window
/// wakes again, of a recent one is a duplicate, in a fold that kept everything in memory and in
/// folds that let go of everything now and then (started empty, and restored).
#[test]
fn linear_receipts_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory() {
    use anima_projections::linear::LINEAR_RECEIPTS_MAX;
    let mut kept = Scenario::new();
    let mut evicting = [Scenario::evicting(false), Scenario::evicting(true)];
    // 20 receipts more than the window: the first 20 are pushed out.
    let total = LINEAR_RECEIPTS_MAX as u64 + 20;
    for n in 0..total {
        fold_all(&mut kept, &mut evicting, linear_created(n, ""), n % 1_024 == 0 || n + 1 == total);
    }
    // The newest and the oldest still remembered are duplicates; 19, pushed out, is new again
    // (and pushes 20 out), as is 0.
    let mut duplicates = Vec::new();
    for n in [total - 1, 20, 19, 0] {
        let seq = fold_all(&mut kept, &mut evicting, linear_created(n, ":again"), true);
        match kept.log.state.verdict(seq) {
            Some(Verdict::LinearSession(session)) => duplicates.push(session.duplicate_receipt),
            other => panic!("not a session verdict: {other:?}"),
        }
    }
    assert_eq!(duplicates, [true, true, false, false]);
    assert_same_as_kept(&kept, &evicting);
    for scenario in &evicting {
        assert_eq!(scenario.log.state.linear_receipts.resident_len(), 0, "the receipts left memory");
    }
}

/// The window of Linear responses is cold too. A response whose outcome is unknown blocks a
/// different response to the same inputs until it leaves the window; then its activity is no
/// longer known. Alike with and without the responses in memory.
#[test]
fn linear_responses_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory() {
    use anima_projections::linear::LINEAR_RESPONSES_MAX;
    use anima_projections::proto::{
        LinearResponseKind, LinearResponseOutcome, LinearResponseRequested, LinearResponseResult,
    };
    let respond = |n: u64, input: &str, body: &str| Envelope {
        event_id: format!("respond:{n}"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearResponse(LinearResponseRequested {
            agent_id: "anna".to_owned(),
            session_id: "00000000-0000-4000-8000-000000000000".to_owned(),
            kind: LinearResponseKind::Response as i32,
            body: body.to_owned(),
            input_ids: vec![input.to_owned()],
        })),
    };
    let outcome = |activity: &str, result: LinearResponseResult| Envelope {
        event_id: format!("outcome:{activity}:{}", result.as_str_name()),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::LinearResponseOutcome(LinearResponseOutcome {
            agent_id: "anna".to_owned(),
            activity_id: activity.to_owned(),
            result: result as i32,
        })),
    };
    let mut kept = Scenario::new();
    let mut evicting = [Scenario::evicting(false), Scenario::evicting(true)];
    fold_all(&mut kept, &mut evicting, linear_created(0, ""), true);
    let activity = |kept: &Scenario, seq: u64| match kept.log.state.verdict(seq) {
        Some(Verdict::LinearResponse(response)) => response.activity_id.clone(),
        other => panic!("not a response verdict: {other:?}"),
    };
    let refused = |kept: &Scenario, seq: u64| matches!(kept.log.state.verdict(seq), Some(Verdict::Refused(_)));
    let first = fold_all(&mut kept, &mut evicting, respond(0, "i0", "first"), true);
    let first_activity = activity(&kept, first);
    fold_all(&mut kept, &mut evicting, outcome(&first_activity, LinearResponseResult::Unknown), true);
    let blocked = fold_all(&mut kept, &mut evicting, respond(1, "i0", "another"), true);
    assert!(refused(&kept, blocked), "an unknown outcome blocks another response to the same inputs");
    // The window's worth of responses after it: the first leaves with the last of them.
    let total = LINEAR_RESPONSES_MAX as u64;
    let mut last = 0;
    for n in 2..total + 2 {
        last =
            fold_all(&mut kept, &mut evicting, respond(n, &format!("i{n}"), "more"), n % 1_024 == 0 || n == total + 1);
    }
    let last_activity = activity(&kept, last);
    let forgotten = fold_all(&mut kept, &mut evicting, outcome(&first_activity, LinearResponseResult::Accepted), true);
    assert!(refused(&kept, forgotten), "the first response left the window");
    let allowed = fold_all(&mut kept, &mut evicting, respond(total + 2, "i0", "another"), true);
    assert!(!refused(&kept, allowed), "the unknown response left the window with it");
    let recent = fold_all(&mut kept, &mut evicting, outcome(&last_activity, LinearResponseResult::Accepted), true);
    assert!(!refused(&kept, recent), "a recent response's outcome is recorded");
    assert_same_as_kept(&kept, &evicting);
    for scenario in &evicting {
        assert_eq!(scenario.log.state.linear_responses.resident_len(), 0, "the responses left memory");
    }
}

/// A state that started empty reads no identity and no settled id back for a message and a
/// wake it never saw, however much it let go of: it counts what it let go of. A restored state
/// cannot know what its checkpoint holds and reads each one (which is what makes this fail if
/// the count is lost).
#[test]
fn new_messages_and_wakes_read_nothing_back_unless_the_state_was_restored() {
    let reads = |restored: bool| {
        let mut evicting = Scenario::evicting(restored);
        for n in 0..200u64 {
            evicting.log.fold(dm_from_human("anna", "D1", &format!("{}.000100", 1_600_000_000 + n), "x"));
            evicting.checkpoint();
            evicting.log.state.evict_cold(usize::MAX);
        }
        assert_eq!(evicting.log.state.cold_resident_len(), 0, "nothing cold stayed in memory");
        let counted = evicting.checkpoint.1.lock().unwrap().clone();
        (counted.get("identities").copied().unwrap_or(0), counted.get("settled_ids").copied().unwrap_or(0))
    };
    assert_eq!(reads(false), (0, 0), "started empty: no read for what was never stored");
    let (identities, settled) = reads(true);
    assert!(identities >= 200 && settled >= 1, "restored: every new key is read ({identities}, {settled})");
}

/// A lookup that found nothing keeps its key in memory, known absent, until the clock's hand
/// passes it unused; eviction shares its slices by all the keys each cold table holds, so the
/// hand of a table of mostly known-absent keys (here the settled ids: every queued wake asks
/// whether its item settled before) comes round at the pace of the others. Shared by present
/// entries alone, it got the smallest slice and its keys piled up.
#[test]
fn known_absent_keys_leave_memory_at_the_pace_of_the_other_tables() {
    let mut evicting = Scenario { evict_always: false, ..Scenario::evicting(false) };
    let dm = |n: u64| dm_from_human("anna", &format!("D{}", n % 40), &format!("{}.000100", 1_600_000_000 + n), "x");
    for n in 0..100 {
        evicting.log.fold(dm(n));
    }
    evicting.checkpoint();
    // The first eviction ends the tables' completeness: from then on a lookup that finds nothing
    // keeps its key.
    evicting.log.state.evict_cold(1);
    for n in 100..2_100 {
        evicting.log.fold(dm(n));
    }
    evicting.checkpoint();
    let state = &mut evicting.log.state;
    let known_absent = |state: &State| state.cold_keys_len() - state.cold_resident_len();
    let before = known_absent(state);
    assert!(before >= 1_000, "{before} known-absent keys: too few to show anything");
    // Slices of 100 until the hands together looked at four times the keys in memory.
    let keys = state.cold_keys_len();
    for _ in 0..(4 * keys).div_ceil(100 * anima_projections::cold::EVICTION_STEPS_PER_ENTRY) {
        state.evict_cold(100);
    }
    let after = known_absent(state);
    assert!(after <= before / 10, "{after} of {before} known-absent keys still in memory");
}

/// Eviction is asked for a number of entries in all, which the cold tables share in proportion
/// to what they hold in memory: the runner evicts in slices of a bounded size so that a request
/// waiting for the state lock waits for about that much work, however many cold tables there
/// are (each table once let go of up to the whole number asked). What is let go of is read back
/// exactly.
#[test]
fn eviction_lets_go_of_about_as_many_entries_as_asked_across_the_cold_tables() {
    let mut kept = Scenario::new();
    let mut evicting = Scenario { evict_always: false, ..Scenario::evicting(false) };
    for n in 0..400u64 {
        let ts = format!("{}.000100", 1_600_000_000 + n);
        let channel = format!("D{}", n % 40);
        for scenario in [&mut kept, &mut evicting] {
            scenario.log.fold(dm_from_human("anna", &channel, &ts, "x"));
        }
    }
    evicting.checkpoint();
    let resident = evicting.log.state.cold_resident_len();
    assert!(resident > 1_000, "{resident} cold entries in memory: too few to share a slice");
    // Identities, their order, journal rows, settled ids and their order.
    const COLD_TABLES: usize = 5;
    let asked = 100;
    let mut slices = 0;
    while evicting.log.state.cold_resident_len() > 0 {
        let before = evicting.log.state.cold_resident_len();
        let let_go = evicting.log.state.evict_cold(asked);
        // Each table's share is rounded up, and every table is asked for one at least.
        assert!(let_go <= asked + COLD_TABLES, "asked for {asked}, {let_go} left memory");
        assert_eq!(evicting.log.state.cold_resident_len(), before - let_go);
        slices += 1;
        assert!(slices <= resident, "eviction stopped letting entries go");
    }
    assert!(slices >= resident / (asked + COLD_TABLES), "{slices} slices let {resident} entries go");
    for n in 0..40u64 {
        let ts = format!("{}.000200", 1_600_000_000 + n);
        for scenario in [&mut kept, &mut evicting] {
            scenario.log.fold(dm_from_human("anna", &format!("D{n}"), &ts, "y"));
        }
    }
    for seq in 1..=kept.log.events.len() as u64 {
        assert_eq!(kept.log.state.verdict(seq), evicting.log.state.verdict(seq), "verdict of seq {seq}");
    }
    assert!(kept.log.state.canonical_bytes() == evicting.log.state.canonical_bytes());
}

#[test]
fn settled_ids_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory() {
    settled_ids_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(false);
    settled_ids_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(true);
}

/// `restored`: see [`Scenario::evicting`].
fn settled_ids_beyond_the_window_are_forgotten_alike_with_nothing_cold_in_memory_when(restored: bool) {
    // An agent settles more wakes than its window remembers; a mention delivery of an old DM
    // (the same message identity, so the same item id) then wakes again in both folds, of a
    // recent one is a duplicate in both — with the settled ids read back from the cold store.
    let mut kept = Scenario::new();
    let mut evicting = Scenario::evicting(restored);
    let total = anima_projections::wake::SETTLED_REMEMBERED_MAX as u64 + 20;
    let dm = |n: u64| dm_from_human("anna", "D1", &format!("{}.000100", 1_600_000_000 + n), "x");
    fn both(kept: &mut Scenario, evicting: &mut Scenario, envelope: Envelope) -> u64 {
        let seq = kept.log.fold(envelope.clone());
        evicting.log.fold(envelope);
        if seq.is_multiple_of(512) {
            evicting.checkpoint();
            evicting.log.state.evict_cold(usize::MAX);
        }
        seq
    }
    for n in 0..total {
        both(&mut kept, &mut evicting, dm(n));
        both(&mut kept, &mut evicting, claim("anna", "w1"));
        both(&mut kept, &mut evicting, start("anna", "w1"));
        both(&mut kept, &mut evicting, finish("anna", "w1", anima_projections::proto::WakeOutcome::Completed));
    }
    // Forgetting the 20 oldest read their slots a page of four at a time (a checkpoint with
    // everything let go of may fall between two of them).
    let order_reads = evicting.checkpoint.1.lock().unwrap().get("settled_order").copied().unwrap_or(0);
    assert!((1..=7).contains(&order_reads), "{order_reads} reads of the settle order for 20 forgotten");
    evicting.checkpoint();
    evicting.log.state.evict_cold(usize::MAX);
    assert_eq!(evicting.log.state.cold_resident_len(), 0, "nothing cold stays in memory");
    let redelivered: Vec<u64> =
        [0, total - 5].into_iter().map(|n| both(&mut kept, &mut evicting, dm(n).app_mention())).collect();
    let woke = |state: &State, seq: u64| match state.verdict(seq) {
        Some(anima_projections::verdict::Verdict::Journaled(journal)) => journal.wake.is_some(),
        other => panic!("not journaled: {other:?}"),
    };
    assert!(woke(&kept.log.state, redelivered[0]), "settled beyond the window: wakes again");
    assert!(!woke(&kept.log.state, redelivered[1]), "settled within the window: a duplicate");
    for seq in 1..=kept.log.events.len() as u64 {
        assert_eq!(kept.log.state.verdict(seq), evicting.log.state.verdict(seq), "verdict of seq {seq}");
    }
    assert!(kept.log.state.canonical_bytes() == evicting.log.state.canonical_bytes());
}

/// A message from Uma in anna's chat `chat` of `kind`.
fn chat_to_anna(kind: anima_projections::proto::ChatKind, chat: &str, message_id: &str) -> Envelope {
    Envelope {
        event_id: format!("chat:t1:{chat}:{message_id}:anna"),
        occurred_at_ms: 0,
        min_reader_version: 1,
        source: "test".to_owned(),
        payload: Some(Payload::ChatMessage(anima_projections::proto::ChatMessageObserved {
            receiving_agent_id: "anna".to_owned(),
            tenant_id: "t1".to_owned(),
            chat_id: chat.to_owned(),
            chat_kind: kind as i32,
            message_id: message_id.to_owned(),
            sender_id: "ou_uma".to_owned(),
            sender_name: "Uma".to_owned(),
            text: "are you there?".to_owned(),
            ..Default::default()
        })),
    }
}

/// The chat kinds and the DM members are cold: read back from the store, a p2p chat is still
/// direct (its messages wake as `dm`) and a DM's listed member still refuses a send, in folds
/// that let go of everything (started empty, and restored) as in one that kept everything.
#[test]
fn chat_kinds_and_dm_members_decide_alike_with_nothing_cold_in_memory() {
    use anima_projections::do_not_contact::NotContactedReason;
    use anima_projections::proto::ChatKind;
    use anima_projections::surface::SurfaceId;
    let mut kept = Scenario::new();
    let mut evicting = [Scenario::evicting(false), Scenario::evicting(true)];
    fold_all(&mut kept, &mut evicting, do_not_contact(&[("T1", &["U9"])]), true);
    fold_all(&mut kept, &mut evicting, dm_from_human("anna", "D9", &ts(1), "hi").by_user("U9", "Nina"), true);
    fold_all(&mut kept, &mut evicting, chat_to_anna(ChatKind::P2p, "p1", "om_1"), true);
    fold_all(&mut kept, &mut evicting, chat_to_anna(ChatKind::Group, "g1", "om_2"), true);
    for scenario in &evicting {
        let state = &scenario.log.state;
        assert_eq!(state.cold_resident_len(), 0, "nothing cold stayed in memory");
        assert_eq!((state.chat_kinds.resident_len(), state.dm_members.resident_len()), (0, 0));
        assert!(state.is_direct(&SurfaceId::chat_message("t1", "p1", "om_1", "")), "p1 is p2p, read from the store");
        assert!(!state.is_direct(&SurfaceId::chat_message("t1", "g1", "om_2", "")), "g1 is a group");
    }
    let refused = fold_all(&mut kept, &mut evicting, send("anna", "D9"), true);
    let again = fold_all(&mut kept, &mut evicting, chat_to_anna(ChatKind::P2p, "p1", "om_3"), true);
    for scenario in &evicting {
        match scenario.log.state.verdict(refused) {
            Some(Verdict::Send(SendVerdict::NotContacted(refusal))) => {
                assert_eq!(refusal.reason, NotContactedReason::Listed, "{refusal:?}");
                assert_eq!(refusal.dm_member.as_deref(), Some("U9"), "the DM's member, read from the store");
            }
            other => panic!("the send into U9's DM is not refused: {other:?}"),
        }
        match scenario.log.state.verdict(again) {
            Some(Verdict::Journaled(journaled)) => {
                assert_eq!(journaled.wake.map(|reason| reason.as_str()), Some("dm"), "{journaled:?}")
            }
            other => panic!("not journaled: {other:?}"),
        }
    }
    assert_same_as_kept(&kept, &evicting);
}
