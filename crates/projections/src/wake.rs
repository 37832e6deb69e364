//! The wake queue of one agent: items in log order, one active (claimed or running) item at a
//! time, and the plans that claims prepare and starts apply.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::intern::AgentKey;
use crate::journal::RowMeta;
use crate::subscription::AttentionNote;
use crate::surface::SurfaceId;

/// Queued items per agent. An observation that would queue more is recorded without a wake, its
/// verdict saying "not queued: queue full" (counted by analytics), rather than growing the
/// queue without bound.
pub const QUEUED_ITEMS_MAX: usize = 10_000;
/// Settles remembered per agent for the duplicate check: the newest this many (an item settled
/// again counts again), each for [`SETTLED_REMEMBERED_NS`].
pub const SETTLED_REMEMBERED_MAX: usize = 4_096;
/// How long a settled item id stays a duplicate, in log time.
pub const SETTLED_REMEMBERED_NS: i64 = 14 * 24 * 3600 * 1_000_000_000;
/// A running wake without a heartbeat for this long (log time) may be recovered.
pub const HEARTBEAT_SILENCE_NS: i64 = 30 * 60 * 1_000_000_000;
/// The claim lease of a claim request that names none (written before leases existed).
pub const CLAIM_LEASE_DEFAULT_SECONDS: u32 = 300;
/// The longest claim lease a request may ask for: a day. A claim that waits longer for its start
/// is stuck by any measure.
pub const CLAIM_LEASE_MAX_SECONDS: u32 = 86_400;

/// Why a wake an observation earned was not queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NotQueued {
    /// Its item id is queued, active, or settled within the remembered window.
    Duplicate,
    /// The agent's queue holds [`QUEUED_ITEMS_MAX`] items: the agent was not woken for it.
    QueueFull,
}

impl NotQueued {
    pub fn as_str(self) -> &'static str {
        match self {
            NotQueued::Duplicate => "duplicate",
            NotQueued::QueueFull => "queue_full",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum WakeReason {
    Dm,
    Mention,
    ThreadFollow,
    ChannelFollow,
    /// A Linear agent session was created or prompted. Never counted for attention notes.
    Linear,
    /// The agent's daily memory pass.
    Memory,
}

impl WakeReason {
    pub fn as_str(self) -> &'static str {
        match self {
            WakeReason::Dm => "dm",
            WakeReason::Mention => "mention",
            WakeReason::ThreadFollow => "thread_follow",
            WakeReason::ChannelFollow => "channel_follow",
            WakeReason::Linear => "linear",
            WakeReason::Memory => "memory",
        }
    }
}

/// One wake waiting in (or taken from) an agent's queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeItem {
    /// The triggering message's identity (`slack:{team}:{channel}:{ts}` or
    /// `chat:{tenant}:{chat}:{message_id}`).
    pub id: String,
    pub reason: WakeReason,
    pub trigger_surface: SurfaceId,
    /// The trigger row, kept here so the wake renders even after the journal window moved on.
    pub trigger: RowMeta,
    /// Where the agent's answer goes.
    pub reply_to: SurfaceId,
    pub queued_seq: u64,
    pub queued_at_ns: i64,
    /// Set when the item comes back after a runtime restart drained it.
    pub resume_after_restart: bool,
    /// A mute suggestion this wake carries.
    pub note: Option<AttentionNote>,
    /// Set for Linear wakes: what the wake text shows besides the prompt. The trigger "row" of a
    /// Linear wake is the session event itself (ordinal 0, on no journal): its body is the prompt.
    pub linear: Option<LinearWake>,
    /// Set for memory passes (item id `memory-pass:{agent}:{window_day}`).
    pub memory: Option<crate::memory::MemoryWake>,
    /// Sizes of the trigger's extras (previews, files) as the wake text renders them.
    pub extras: crate::text::ExtrasSizes,
}

impl WakeItem {
    /// The plain values the frame of its wake text shows, as the text writer takes them.
    pub fn frame(&self) -> crate::text::WakeFrame<'_> {
        crate::text::WakeFrame {
            reason: self.reason.as_str(),
            trigger_surface: &self.trigger_surface,
            trigger: &self.trigger,
            reply_to: &self.reply_to,
            resume_after_restart: self.resume_after_restart,
        }
    }
}

/// The non-content fields of the Linear session event behind a wake.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearWake {
    pub kind: crate::surface::LinearReceiptKind,
    pub session_id: String,
    /// The prompt's agent activity id (`prompted` only; empty for `created`).
    pub agent_activity_id: String,
    pub issue_identifier: String,
    pub issue_url: String,
}

/// One surface of a plan: the cursor the start expects, and where the start moves it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanEntry {
    pub surface: SurfaceId,
    pub expected: Option<u64>,
    pub target: u64,
}

impl PlanEntry {
    /// The entry as a runtime sends it back in its `Start` (and as a claim hands it out).
    pub fn to_plan_surface(&self) -> crate::proto::PlanSurface {
        crate::proto::PlanSurface {
            surface: self.surface.to_string(),
            expected_present: self.expected.is_some(),
            expected_ordinal: self.expected.unwrap_or(0),
            target_ordinal: self.target,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveWake {
    pub item: WakeItem,
    pub worker: String,
    pub plan: Vec<PlanEntry>,
    pub claimed_seq: u64,
    /// `Some` once a start was accepted.
    pub started_seq: Option<u64>,
    /// Log time of the claim, then of the accepted start, then of the newest heartbeat.
    pub last_alive_ns: i64,
    /// How long a claimed (not started) wake stays claimed after its last sign of life, in log
    /// nanoseconds; the claim request carried it.
    pub claim_lease_ns: i64,
}

impl ActiveWake {
    /// Whether this is a claim whose lease ran out by log time `at_ns`: never started, and no
    /// sign of life for the whole lease. Such a claim is dead: its start is refused and the
    /// recovery loop re-queues it.
    pub fn claim_lease_expired(&self, at_ns: i64) -> bool {
        self.started_seq.is_none() && at_ns.saturating_sub(self.last_alive_ns) >= self.claim_lease_ns
    }

    /// Log time at which a claimed wake's lease runs out.
    pub fn claim_lease_ends_ns(&self) -> i64 {
        self.last_alive_ns.saturating_add(self.claim_lease_ns)
    }
}

/// The lease a claim request asks for, in log nanoseconds (0: the default; bounded).
pub fn claim_lease_ns(claim_lease_seconds: u32) -> i64 {
    let seconds = match claim_lease_seconds {
        0 => CLAIM_LEASE_DEFAULT_SECONDS,
        seconds => seconds.min(CLAIM_LEASE_MAX_SECONDS),
    };
    i64::from(seconds) * 1_000_000_000
}

/// One agent's queue. It is checkpointed as a small header (the active wake and counters) plus
/// one entry per queued item keyed by its slot, so queuing or taking one item writes that item,
/// never the whole queue (a queue holds up to [`QUEUED_ITEMS_MAX`] items).
///
/// Items are held by slot, and slots ascend in queue order, so the queue is a map from slot to
/// item: taking an item anywhere in it moves no other. Two derived indexes serve the per-event
/// questions without a scan: the slot of each queued id (the duplicate check of every new wake,
/// a claim naming its item) and, per trigger surface, the queued items by trigger ordinal (what
/// the cursors of an accepted start cover).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentQueue {
    /// Waiting items by slot (queue order); changed only through the methods below, which keep
    /// the indexes in step. Items queued at the back take slots above the middle of the range,
    /// items put back at the front slots below it.
    /// Shared with a checkpoint that took them and encodes them beside the fold
    /// ([`crate::changes`]): taking a changed item copies a reference, not the item.
    items: BTreeMap<u64, std::sync::Arc<WakeItem>>,
    pub active: Option<ActiveWake>,
    /// How many settles are remembered for this agent (at most [`SETTLED_REMEMBERED_MAX`]).
    pub settled_remembered: u32,
    /// Order of the next settled id, so the oldest can be forgotten first.
    pub settled_counter: u64,
    /// Slots taken at the back and at the front so far.
    back_taken: u64,
    front_taken: u64,
    /// Slots whose item changed (queued or taken) since the last checkpoint.
    changed_slots: ChangedSlots,
    /// The slot of each id in `items`. Derived: rebuilt when a checkpoint loads; only looked up,
    /// never iterated.
    queued_ids: crate::hashed::HashedMap<String, u64>,
    /// Per trigger surface (a fingerprint; the surface itself is compared on a match), the
    /// queued items a start may settle — those not resuming after a restart — as (trigger
    /// ordinal, slot). Derived like `queued_ids`; looked up by fingerprint, ranges in order.
    coverage: crate::hashed::HashedMap<u64, BTreeSet<(u64, u64)>>,
    /// How many items wait, in memory or still in the store: kept by the methods that queue
    /// and take items, and loaded with the header.
    len: u64,
    /// Set on a queue restored from a checkpoint whose items were left in the store: a restart
    /// loads only headers, and an agent's items come into memory the first time the fold
    /// touches its queue ([`crate::State::ensure_queue`]). Item methods assert it is clear.
    items_in_store: bool,
}

/// Slots whose item changed since the last checkpoint, and how many slots had been taken at the
/// back and at the front when that checkpoint drained them. Slots are never reused, so a slot
/// taken after that was in no checkpoint: if its item is gone again, the next checkpoint has
/// nothing to remove. Only the slots are state; the counts say what the store holds, so they
/// do not take part in comparisons.
#[derive(Clone, Debug, Default)]
struct ChangedSlots {
    slots: BTreeSet<u64>,
    back_drained: u64,
    front_drained: u64,
}

impl PartialEq for ChangedSlots {
    fn eq(&self, other: &Self) -> bool {
        self.slots == other.slots
    }
}

impl Eq for ChangedSlots {}

impl ChangedSlots {
    /// Whether `slot` was taken after the last drain (so no checkpoint holds it).
    fn taken_since_drain(&self, slot: u64) -> bool {
        slot >= SLOT_MIDDLE + self.back_drained || slot < SLOT_MIDDLE - self.front_drained
    }
}

/// A queued item changed since the last checkpoint, by slot (`None`: taken from the queue),
/// shared with the queue.
pub type ChangedItem = (u64, Option<std::sync::Arc<WakeItem>>);

/// The checkpointed part of an [`AgentQueue`] besides its items.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueHeader {
    pub active: Option<ActiveWake>,
    pub settled_remembered: u32,
    pub settled_counter: u64,
    pub back_taken: u64,
    pub front_taken: u64,
    /// How many items wait (so a restart need not load them to know).
    pub queued: u64,
}

/// The middle of the slot range: the first slot at the back.
const SLOT_MIDDLE: u64 = 1 << 63;

/// A hash of a surface with fixed keys. Only compared in memory, never persisted.
fn surface_fingerprint(surface: &SurfaceId) -> u64 {
    use std::hash::BuildHasher;
    crate::hashed::Hasher::default().hash_one(surface)
}

impl AgentQueue {
    /// Whether `item_id` is queued or active.
    pub fn holds(&self, item_id: &str) -> bool {
        self.assert_items_in_memory();
        self.queued_ids.contains_key(item_id) || self.active.as_ref().is_some_and(|a| a.item.id == item_id)
    }

    fn assert_items_in_memory(&self) {
        debug_assert!(!self.items_in_store, "a queue's items read before State::ensure_queue brought them in");
    }

    /// The waiting items, in queue order. On a restored queue whose items are still in the
    /// store, use [`crate::State::queued_items`] (which reads through).
    pub fn queued(&self) -> impl DoubleEndedIterator<Item = &WakeItem> + ExactSizeIterator + Clone {
        self.assert_items_in_memory();
        self.items.values().map(|item| &**item)
    }

    /// How many items wait (in memory or not).
    pub fn queued_len(&self) -> usize {
        debug_assert!(self.items_in_store || self.len == self.items.len() as u64, "the count follows the items");
        usize::try_from(self.len).unwrap_or(usize::MAX)
    }

    /// Items in memory (for the state's memory estimate).
    pub fn resident_len(&self) -> usize {
        self.items.len()
    }

    /// Whether the items are still in the checkpoint store.
    pub fn items_in_store(&self) -> bool {
        self.items_in_store
    }

    /// After a restore that left the items in the store: marks a queue with items as such.
    pub(crate) fn leave_items_in_store(&mut self) {
        debug_assert!(self.items.is_empty(), "a lazy restore loads no items");
        self.items_in_store = self.len > 0;
    }

    /// Brings in the items read from the store (all of them, any order).
    pub(crate) fn load_stored_items(&mut self, items: Vec<(u64, WakeItem)>) {
        self.items_in_store = false;
        for (slot, item) in items {
            self.insert(slot, item);
        }
        debug_assert_eq!(self.items.len() as u64, self.len, "the store holds every queued item");
    }

    /// Whether no item waits.
    pub fn nothing_queued(&self) -> bool {
        self.items.is_empty()
    }

    /// The slot of the first waiting item.
    pub(crate) fn first_slot(&self) -> Option<u64> {
        self.assert_items_in_memory();
        self.items.keys().next().copied()
    }

    /// The slot of the waiting item `item_id`.
    pub(crate) fn slot_of(&self, item_id: &str) -> Option<u64> {
        self.assert_items_in_memory();
        self.queued_ids.get(item_id).copied()
    }

    /// The waiting item in `slot`.
    pub(crate) fn item(&self, slot: u64) -> Option<&WakeItem> {
        self.assert_items_in_memory();
        self.items.get(&slot).map(|item| &**item)
    }

    fn insert(&mut self, slot: u64, item: WakeItem) {
        self.assert_items_in_memory();
        self.queued_ids.insert(item.id.clone(), slot);
        if !item.resume_after_restart {
            self.coverage
                .entry(surface_fingerprint(&item.trigger_surface))
                .or_default()
                .insert((item.trigger.ordinal, slot));
        }
        let replaced = self.items.insert(slot, std::sync::Arc::new(item));
        debug_assert!(replaced.is_none(), "a slot holds one item");
    }

    pub(crate) fn push_back(&mut self, item: WakeItem) {
        let slot = SLOT_MIDDLE + self.back_taken;
        self.back_taken += 1;
        self.changed_slots.slots.insert(slot);
        self.len += 1;
        self.insert(slot, item);
    }

    pub(crate) fn push_front(&mut self, item: WakeItem) {
        let slot = SLOT_MIDDLE - 1 - self.front_taken;
        self.front_taken += 1;
        self.changed_slots.slots.insert(slot);
        self.len += 1;
        self.insert(slot, item);
    }

    /// Takes the item in `slot` out of the queue.
    pub(crate) fn remove(&mut self, slot: u64) -> Option<WakeItem> {
        self.assert_items_in_memory();
        let item = std::sync::Arc::unwrap_or_clone(self.items.remove(&slot)?);
        self.changed_slots.slots.insert(slot);
        self.len -= 1;
        self.queued_ids.remove(&item.id);
        if !item.resume_after_restart {
            let fingerprint = surface_fingerprint(&item.trigger_surface);
            if let Some(entries) = self.coverage.get_mut(&fingerprint) {
                entries.remove(&(item.trigger.ordinal, slot));
                if entries.is_empty() {
                    self.coverage.remove(&fingerprint);
                }
            }
        }
        Some(item)
    }

    /// Keeps the items `keep` accepts; returns the ids of the others, in queue order.
    pub(crate) fn retain(&mut self, mut keep: impl FnMut(&WakeItem) -> bool) -> Vec<String> {
        self.assert_items_in_memory();
        let dropped: Vec<u64> = self.items.iter().filter(|(_, item)| !keep(item)).map(|(slot, _)| *slot).collect();
        dropped.into_iter().filter_map(|slot| self.remove(slot)).map(|item| item.id).collect()
    }

    /// The checkpointed header.
    pub fn header(&self) -> QueueHeader {
        QueueHeader {
            active: self.active.clone(),
            settled_remembered: self.settled_remembered,
            settled_counter: self.settled_counter,
            back_taken: self.back_taken,
            front_taken: self.front_taken,
            queued: self.queued_len() as u64,
        }
    }

    /// Loads the header from a checkpoint.
    pub fn load_header(&mut self, header: QueueHeader) {
        self.active = header.active;
        self.settled_remembered = header.settled_remembered;
        self.settled_counter = header.settled_counter;
        self.back_taken = header.back_taken;
        self.front_taken = header.front_taken;
        self.changed_slots.back_drained = header.back_taken;
        self.changed_slots.front_drained = header.front_taken;
        self.len = header.queued;
    }

    /// Loads one queued item from a checkpoint, in slot order whatever order they come in.
    pub fn load_item(&mut self, slot: u64, item: WakeItem) {
        self.insert(slot, item);
    }

    /// Queued items by slot, in queue order (the canonical encoding).
    pub fn slotted(&self) -> impl Iterator<Item = (u64, &WakeItem)> {
        self.assert_items_in_memory();
        self.items.iter().map(|(slot, item)| (*slot, &**item))
    }

    /// Items changed since the last call, by slot (`None`: taken from the queue, and held by
    /// the last checkpoint; an item queued and taken since then is left out).
    pub fn drain_item_changes(&mut self) -> Vec<ChangedItem> {
        let drained = std::mem::replace(
            &mut self.changed_slots,
            ChangedSlots { slots: BTreeSet::new(), back_drained: self.back_taken, front_drained: self.front_taken },
        );
        let items = &self.items;
        drained
            .slots
            .iter()
            .filter_map(|&slot| match items.get(&slot) {
                None if drained.taken_since_drain(slot) => None,
                item => Some((slot, item.cloned())),
            })
            .collect()
    }

    /// Items changed and not yet checkpointed.
    pub fn changed_items_len(&self) -> usize {
        self.changed_slots.slots.len()
    }

    /// Slots of the queued items that `moved` cursors cover, in queue order: not resuming after
    /// a restart, and a moved cursor of their trigger surface at or past their trigger. Looks
    /// only at the items of the moved surfaces up to each cursor.
    fn covered_slots(&self, moved: &[(&SurfaceId, u64)]) -> Vec<u64> {
        self.assert_items_in_memory();
        let mut slots = Vec::new();
        for (surface, cursor) in moved {
            let Some(entries) = self.coverage.get(&surface_fingerprint(surface)) else { continue };
            slots.extend(
                entries
                    .range(..=(*cursor, u64::MAX))
                    .map(|(_, slot)| *slot)
                    .filter(|slot| self.items.get(slot).is_some_and(|item| item.trigger_surface == **surface)),
            );
        }
        slots.sort_unstable();
        slots.dedup();
        slots
    }
}

/// Settled item ids are remembered per agent for the duplicate check of every new wake: the
/// newest [`SETTLED_REMEMBERED_MAX`] settles of the agent (an id settled again counts again),
/// each for 14 days. Two cold tables hold them ([`State::settled_ids`], [`State::settled_order`]):
/// an idle agent's ids leave memory under the budget and are read back when a wake is queued.
/// (agent, item id) → (its newest settle order, log time it settled).
pub type SettledId = (u64, i64);

/// The settle order of the window is checkpointed in slots: the settle that enters an agent's
/// window overwrites the one that leaves it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SettledSlots;

impl crate::cold::Slots<(AgentKey, u64), (u64, String)> for SettledSlots {
    fn slot(&(agent, order): &(AgentKey, u64)) -> (AgentKey, u64) {
        (agent, order % SETTLED_REMEMBERED_MAX as u64)
    }
    fn holds(&(_, order): &(AgentKey, u64), &(stored, _): &(u64, String)) -> bool {
        stored == order
    }
    fn key_of((agent, _): (AgentKey, u64), &(order, _): &(u64, String)) -> (AgentKey, u64) {
        (agent, order)
    }
}

use crate::proto;
use crate::state::{LogPosition, State, SETTLED_IDS_TAG, SETTLED_ORDER_TAG};
use crate::text::{self, ROWS_SHOWN_MAX, TEXT_BYTES_MAX};
use crate::verdict::refused;
use crate::verdict::{ClaimVerdict, ClaimedWake, MovedCursor, RefusalKind, Verdict};

impl State {
    /// Queues `item` unless its id is active, queued, or settled within the remembered window,
    /// or the agent's queue is full. Returns the reason when it was queued, else why not.
    pub(crate) fn queue_wake(&mut self, at: LogPosition, agent: &str, item: WakeItem) -> Result<WakeReason, NotQueued> {
        self.ensure_queue(agent);
        let settled_at = self.agent_keys.key(agent).and_then(|agent| self.settled_at(agent, &item.id));
        if let Some(settled_at) = settled_at {
            if at.at_ns.saturating_sub(settled_at) < SETTLED_REMEMBERED_NS {
                return Err(NotQueued::Duplicate);
            }
        }
        // Looked at, not changed: the queue is created and marked changed only when the item
        // is queued below.
        if let Some(queue) = self.queues.get(agent) {
            if queue.holds(&item.id) {
                return Err(NotQueued::Duplicate);
            }
            if queue.queued_len() >= QUEUED_ITEMS_MAX {
                return Err(NotQueued::QueueFull);
            }
        }
        let mut item = item;
        let reason = item.reason;
        item.note = self.count_follow_wake(at, agent, reason, &item.trigger_surface);
        let queue = self.queues.entry_or_default_by(agent);
        queue.push_back(item);
        debug_assert!(queue.queued_len() <= QUEUED_ITEMS_MAX, "a queue never grows beyond its bound");
        self.note_memory_history(at, agent);
        Ok(reason)
    }

    /// Records that `item_id` settled, forgetting the agent's oldest settled id beyond the bound.
    /// Several items can settle at one log position (a claim settles covered items on its way),
    /// so the order is a per-agent counter, and a settled entry is only forgotten by the order
    /// entry that wrote it (an id settled again later keeps its newer entry).
    fn remember_settled(&mut self, at: LogPosition, agent: &str, item_id: &str) {
        let agent_key = self.agent_keys.intern(agent);
        let queue = self.queues.entry_or_default_by(agent);
        let order = queue.settled_counter;
        queue.settled_counter += 1;
        queue.settled_remembered =
            u32::try_from(queue.settled_counter.min(SETTLED_REMEMBERED_MAX as u64)).unwrap_or(u32::MAX);
        let settled = (agent_key, item_id.to_owned());
        self.settled_ids.ensure_for_write(SETTLED_IDS_TAG, &settled, &self.cold);
        self.settled_ids.insert(settled, (order, at.at_ns));
        self.settled_order.insert((agent_key, order), (order, item_id.to_owned()));
        if order >= SETTLED_REMEMBERED_MAX as u64 {
            let oldest = (agent_key, order - SETTLED_REMEMBERED_MAX as u64);
            // The oldest's slot page holds the next three oldest too, forgotten at the next
            // settles: one read for four (under `anima-load` the settle order was the second
            // most frequent of the fold's reads back, and the most often slow; README stop 51).
            self.settled_order.ensure_with_page(SETTLED_ORDER_TAG, &oldest, &self.cold);
            if let Some((old_order, old_id)) = self.settled_order.remove(&oldest) {
                // The id may have settled again since: then its entry is the newer one and stays.
                let key = (agent_key, old_id);
                self.settled_ids.ensure(SETTLED_IDS_TAG, &key, &self.cold);
                if self.settled_ids.get(&key).is_some_and(|(order, _)| *order == old_order) {
                    self.settled_ids.remove(&key);
                }
            }
        }
    }

    /// Log time `item_id` last settled for `agent`, if it is still remembered (read back from
    /// the checkpoint when it left memory).
    fn settled_at(&mut self, agent: AgentKey, item_id: &str) -> Option<i64> {
        let key = (agent, item_id.to_owned());
        self.settled_ids.ensure(SETTLED_IDS_TAG, &key, &self.cold);
        self.settled_ids.get(&key).map(|(_, at_ns)| *at_ns)
    }

    /// The agent's remembered settled ids, oldest first, and when each settled (for tools and
    /// tests: reads the checkpoint for what left memory, keeps nothing).
    pub fn settled_of(&self, agent: &str) -> Vec<(String, i64)> {
        let (Some(agent_key), Some(queue)) = (self.agent_keys.key(agent), self.queue(agent)) else { return Vec::new() };
        let first = queue.settled_counter.saturating_sub(SETTLED_REMEMBERED_MAX as u64);
        (first..queue.settled_counter)
            .filter_map(|order| {
                let (_, id) = self.settled_order.read_through(SETTLED_ORDER_TAG, &(agent_key, order), &self.cold)?;
                let (newest, at_ns) =
                    self.settled_ids.read_through(SETTLED_IDS_TAG, &(agent_key, id.clone()), &self.cold)?;
                (newest == order).then_some((id, at_ns))
            })
            .collect()
    }

    /// The surfaces a wake's plan covers: the trigger's surface, and the surface the answer goes
    /// to when that is another one — the response thread at the trigger, for a channel's (or a
    /// group chat's) top level. DMs, p2p chats and threads are answered where they are.
    fn plan_surfaces(item: &WakeItem) -> Vec<SurfaceId> {
        if item.linear.is_some() || item.memory.is_some() {
            // A Linear session and a memory have no journal: their plans move nothing.
            Vec::new()
        } else if item.reply_to != item.trigger_surface {
            vec![item.trigger_surface.clone(), item.reply_to.clone()]
        } else {
            vec![item.trigger_surface.clone()]
        }
    }

    /// Prepares a plan: the rows after the cursors, newest first across the plan's surfaces,
    /// until 20 rows or the byte budget; the trigger always included. Moves nothing.
    fn prepare_wake(&self, agent: &str, item: &WakeItem) -> (Vec<PlanEntry>, Vec<RowMeta>, u64, text::Extras) {
        let surfaces = Self::plan_surfaces(item);
        // The trigger and its extras come first (extras shrunk as far as needed to fit); the
        // rows get what is left.
        let frame = text::wake_frame_bytes_max(&item.frame(), &item.extras);
        let note_bytes = text::note_bytes(item.note.as_ref());
        let extras = text::Extras::fit(TEXT_BYTES_MAX.saturating_sub(frame), note_bytes, &item.extras);
        let mut budget = TEXT_BYTES_MAX.saturating_sub(frame + extras.bytes(note_bytes, &item.extras));
        let mut candidates: Vec<(&SurfaceId, &RowMeta)> = Vec::new();
        let mut after_cursors = 0u64;
        for surface in &surfaces {
            let cursor = self.cursor(agent, surface).unwrap_or(0);
            if let Some((key, tail)) = self.surface_key(surface).and_then(|k| Some((k, self.journal_by_key(k)?.tail))) {
                after_cursors += tail.saturating_sub(cursor);
                candidates.extend(
                    self.newest_rows_after(key, cursor)
                        .filter(|r| !(surface == &item.trigger_surface && r.ordinal == item.trigger.ordinal))
                        .take(ROWS_SHOWN_MAX)
                        .map(|r| (surface, r)),
                );
            }
        }
        candidates.sort_by_key(|c| std::cmp::Reverse(c.1.seq));
        let mut selected: Vec<(&SurfaceId, &RowMeta)> = Vec::new();
        for (surface, row) in candidates {
            let bytes = row.bytes_for(agent);
            if selected.len() + 1 >= ROWS_SHOWN_MAX || bytes > budget {
                break;
            }
            budget -= bytes;
            selected.push((surface, row));
        }
        let plan = surfaces
            .iter()
            .map(|surface| {
                let expected = self.cursor(agent, surface);
                let mut target = expected.unwrap_or(0);
                if surface == &item.trigger_surface {
                    target = target.max(item.trigger.ordinal);
                }
                for (_, row) in selected.iter().filter(|(s, _)| *s == surface) {
                    target = target.max(row.ordinal);
                }
                PlanEntry { surface: surface.clone(), expected, target }
            })
            .collect();
        let trigger_after_cursor =
            u64::from(self.cursor(agent, &item.trigger_surface).unwrap_or(0) < item.trigger.ordinal);
        let not_shown = after_cursors.saturating_sub(selected.len() as u64 + trigger_after_cursor);
        // Conversation-time order: Slack ts, then log order. Chat rows carry the log's time, so
        // their order is the log's.
        let order = |(surface, row): &(&SurfaceId, &RowMeta)| {
            (row.ts_seconds, surface.orders_by_ts().then(|| row.ts.clone()), row.seq)
        };
        selected.sort_by_cached_key(order);
        let rows: Vec<RowMeta> = selected.into_iter().map(|(_, r)| r.clone()).collect();
        (plan, rows, not_shown, extras)
    }

    pub(crate) fn claim_wake(&mut self, at: LogPosition, request: &proto::WakeClaimRequested) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let agent = request.agent_id.clone();
        if !self.agents.contains_key(&agent) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        if request.worker_id.is_empty() {
            return refused(RefusalKind::InvalidArgument, "worker_id is empty");
        }
        if let Some(active) = self.queue(&agent).and_then(|q| q.active.as_ref()) {
            let state = if active.started_seq.is_some() {
                "running".to_owned()
            } else {
                format!(
                    "claimed (by {}; its lease ends {} s from now unless it starts or heart-beats)",
                    active.worker,
                    active.claim_lease_ends_ns().saturating_sub(at.at_ns).max(0) / 1_000_000_000
                )
            };
            return refused(RefusalKind::Aborted, format!("the agent already has a {state} wake; this claim lost"));
        }
        let mut settled_without_turn = Vec::new();
        loop {
            let Some(queue) = self.queues.get(&agent) else {
                return Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn });
            };
            let slot = if request.item_id.is_empty() {
                match queue.first_slot() {
                    Some(slot) => slot,
                    None => return Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn }),
                }
            } else {
                match queue.slot_of(&request.item_id) {
                    Some(slot) => slot,
                    None if settled_without_turn.contains(&request.item_id) => {
                        return Verdict::Claim(ClaimVerdict::Nothing { settled_without_turn })
                    }
                    None => {
                        return refused(
                            RefusalKind::Aborted,
                            "that item is not queued for this agent (claimed elsewhere or settled)",
                        )
                    }
                }
            };
            let item = queue.item(slot).expect("a slot of the queue");
            let covered = self.cursor(&agent, &item.trigger_surface).is_some_and(|c| c >= item.trigger.ordinal);
            if covered && !item.resume_after_restart {
                let item = self.queues.get_mut(&agent).and_then(|q| q.remove(slot)).expect("queued");
                self.remember_settled(at, &agent, &item.id);
                settled_without_turn.push(item.id);
                continue;
            }
            let item = self.queues.get_mut(&agent).and_then(|q| q.remove(slot)).expect("queued");
            for surface in Self::plan_surfaces(&item) {
                if let Some(key) = self.ensure_surface_state(&agent, &surface) {
                    let cursor = self.cursor(&agent, &surface).unwrap_or(0);
                    self.ensure_rows_after(key, cursor);
                }
            }
            let (plan, rows, not_shown, extras) = self.prepare_wake(&agent, &item);
            let queue = self.queues.get_mut(&agent).expect("queue exists");
            queue.active = Some(ActiveWake {
                item: item.clone(),
                worker: request.worker_id.clone(),
                plan: plan.clone(),
                claimed_seq: at.seq,
                started_seq: None,
                last_alive_ns: at.at_ns,
                claim_lease_ns: claim_lease_ns(request.claim_lease_seconds),
            });
            return Verdict::Claim(ClaimVerdict::Claimed(Box::new(ClaimedWake {
                item,
                worker: request.worker_id.clone(),
                plan,
                rows,
                not_shown,
                settled_without_turn,
                memory_md_bytes: request.memory_md_bytes,
                consolidation_threshold_bytes: self.memory_config().consolidation_threshold_bytes,
                extras,
            })));
        }
    }

    pub(crate) fn start_wake(&mut self, at: LogPosition, request: &proto::WakeStartRequested) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let agent = request.agent_id.clone();
        let Some(active) = self.queue(&agent).and_then(|q| q.active.clone()) else {
            return refused(RefusalKind::FailedPrecondition, "no wake of this agent is claimed");
        };
        if active.item.id != request.item_id || active.worker != request.worker_id {
            // A lost claim (its lease expired and another worker took the item) looks the same
            // from here as a claim never made; either way claiming again is the way forward.
            return refused(RefusalKind::Aborted, "that item is not claimed by this worker (claim again)");
        }
        if active.started_seq.is_some() {
            return refused(RefusalKind::FailedPrecondition, "that wake already started");
        }
        if active.claim_lease_expired(at.at_ns) {
            return self.release_expired_claim(&agent, &active, "start");
        }
        let mut plan = Vec::with_capacity(request.plan.len());
        for entry in &request.plan {
            let Some(surface) = SurfaceId::parse(&entry.surface) else {
                return refused(
                    RefusalKind::InvalidArgument,
                    format!("plan surface {:?} is not a surface key", entry.surface),
                );
            };
            plan.push(PlanEntry {
                surface,
                expected: entry.expected_present.then_some(entry.expected_ordinal),
                target: entry.target_ordinal,
            });
        }
        if plan != active.plan {
            return refused(
                RefusalKind::InvalidArgument,
                "plan: differs from the one the claim prepared; hand it back unchanged",
            );
        }
        if let Some(moved) = plan.iter().find(|p| self.cursor(&agent, &p.surface) != p.expected) {
            let message = format!(
                "plan is stale: the cursor of {} moved from {} to {} since the claim; claim again",
                moved.surface,
                describe_cursor(moved.expected),
                describe_cursor(self.cursor(&agent, &moved.surface))
            );
            let queue = self.queues.get_mut(&agent).expect("queue exists");
            if let Some(active) = queue.active.take() {
                queue.push_front(active.item);
            }
            return refused(RefusalKind::Aborted, message);
        }
        // Every cursor of the plan is checked before any moves: the start moves all or none.
        for entry in &plan {
            if let Err(broken) = self.check_cursor_advance(&agent, &entry.surface, entry.target) {
                return refused(
                    RefusalKind::FailedPrecondition,
                    format!("plan target {} of {}: {broken}", entry.target, entry.surface),
                );
            }
        }
        let agent_key = self.agent_keys.intern(&agent);
        let mut moved = Vec::with_capacity(plan.len());
        for entry in &plan {
            let key = (agent_key, self.intern_surface(&entry.surface));
            let advanced = self.advance_cursor(key, entry.target);
            debug_assert!(advanced.is_ok(), "checked above: {advanced:?}");
            if let Ok(advance) = advanced {
                moved.push(MovedCursor {
                    surface: entry.surface.clone(),
                    before: advance.before,
                    after: advance.after,
                    tail: advance.tail,
                });
            }
        }
        if let Some(active) = self.queues.get_mut(&agent).and_then(|q| q.active.as_mut()) {
            active.started_seq = Some(at.seq);
            active.last_alive_ns = at.at_ns;
        }
        if active.item.memory.is_some() {
            self.note_memory_pass_started(at, &active.item.id);
        }
        let coalesced = self.coalesce(at, &agent, &plan);
        Verdict::Started { item_id: request.item_id.clone(), coalesced, moved }
    }

    /// Settles queued items whose trigger rows the start's cursors now cover (derived settles),
    /// except items resuming after a restart. Only the plan's surfaces moved, so only items on
    /// them are looked at; items covered earlier by a send decision settle at the next claim.
    fn coalesce(&mut self, at: LogPosition, agent: &str, plan: &[PlanEntry]) -> Vec<String> {
        let moved: Vec<(&SurfaceId, u64)> =
            plan.iter().filter_map(|p| self.cursor(agent, &p.surface).map(|c| (&p.surface, c))).collect();
        let Some(queue) = self.queues.get(agent) else { return Vec::new() };
        let slots = queue.covered_slots(&moved);
        if slots.is_empty() {
            return Vec::new();
        }
        let queue = self.queues.get_mut(agent).expect("looked up above");
        let covered: Vec<String> =
            slots.into_iter().filter_map(|slot| queue.remove(slot)).map(|item| item.id).collect();
        for id in &covered {
            self.remember_settled(at, agent, id);
        }
        covered
    }

    /// A heartbeat extends a running wake's life and a claimed one's lease, by log time.
    pub(crate) fn record_heartbeat(&mut self, at: LogPosition, request: &proto::WakeHeartbeat) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let active = self.queue(&request.agent_id).and_then(|q| q.active.clone());
        match active {
            Some(active) if active.item.id == request.item_id && active.worker == request.worker_id => {
                if active.claim_lease_expired(at.at_ns) {
                    return self.release_expired_claim(&request.agent_id, &active, "heartbeat");
                }
                let active = self.queues.get_mut(&request.agent_id).and_then(|q| q.active.as_mut());
                let active = active.expect("checked above");
                debug_assert!(active.last_alive_ns <= at.at_ns, "log time is monotonic");
                active.last_alive_ns = at.at_ns;
                Verdict::HeartbeatRecorded
            }
            _ => refused(RefusalKind::FailedPrecondition, "that item is not claimed or running for this worker"),
        }
    }

    /// A claim whose lease ran out is dead at the request that finds it so: the item goes back
    /// to the front of the queue (as it was: a claim moved no cursor) for any worker to claim,
    /// and the request is refused as one that may succeed when redone (claim again).
    fn release_expired_claim(&mut self, agent: &str, active: &ActiveWake, what: &str) -> Verdict {
        let queue = self.queues.get_mut(agent).expect("an active wake has a queue");
        debug_assert!(queue.active.as_ref().is_some_and(|a| a.item.id == active.item.id && a.started_seq.is_none()));
        if let Some(released) = queue.active.take() {
            queue.push_front(released.item);
        }
        refused(
            RefusalKind::Aborted,
            format!(
                "the claim's lease of {} s ran out before this {what} (claimed at seq {}); the wake is queued again: claim again",
                active.claim_lease_ns / 1_000_000_000,
                active.claimed_seq
            ),
        )
    }

    /// Re-queues a running wake whose last sign of life is older than
    /// [`HEARTBEAT_SILENCE_NS`] in log time, to resume after the restart it implies, or a claimed
    /// wake never started within its lease, as it was (it moved no cursor).
    pub(crate) fn recover_wake(&mut self, at: LogPosition, request: &proto::WakeRecoveryRequested) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let Some(queue) = self.queues.get(&request.agent_id) else {
            return refused(RefusalKind::FailedPrecondition, "the agent has no claimed or running wake");
        };
        let started = match &queue.active {
            Some(active) if active.item.id == request.item_id && active.started_seq.is_some() => {
                if at.at_ns.saturating_sub(active.last_alive_ns) < HEARTBEAT_SILENCE_NS {
                    return refused(RefusalKind::Aborted, "the wake's heartbeat is recent; not recovered");
                }
                true
            }
            Some(active) if active.item.id == request.item_id => {
                if !active.claim_lease_expired(at.at_ns) {
                    return refused(RefusalKind::Aborted, "the claim's lease has not run out; not recovered");
                }
                false
            }
            _ => return refused(RefusalKind::FailedPrecondition, "that item is not claimed or running"),
        };
        let queue = self.queues.get_mut(&request.agent_id).expect("checked above");
        let mut item = queue.active.take().expect("checked above").item;
        // Only a started wake may have had side effects to continue after; a claim had none.
        item.resume_after_restart |= started;
        queue.push_front(item);
        Verdict::Recovered { item_id: request.item_id.clone(), started }
    }

    pub(crate) fn finish_wake(&mut self, at: LogPosition, request: &proto::WakeFinishRequested) -> Verdict {
        self.ensure_queue(&request.agent_id);
        let agent = request.agent_id.clone();
        let Some(active) = self.queue(&agent).and_then(|q| q.active.clone()) else {
            return refused(RefusalKind::FailedPrecondition, "no wake of this agent is claimed or running");
        };
        if active.item.id != request.item_id || active.worker != request.worker_id {
            return refused(RefusalKind::FailedPrecondition, "that item is not running for this worker");
        }
        let outcome = proto::WakeOutcome::try_from(request.outcome).unwrap_or(proto::WakeOutcome::Unspecified);
        if outcome == proto::WakeOutcome::Unspecified {
            return refused(RefusalKind::InvalidArgument, "outcome is unspecified");
        }
        let requeue = outcome == proto::WakeOutcome::Aborted && request.restart_drain;
        let is_memory_pass = active.item.memory.is_some();
        if is_memory_pass && outcome == proto::WakeOutcome::Completed {
            for (field, digest) in [
                ("memory_digest_before", &request.memory_digest_before),
                ("memory_digest_after", &request.memory_digest_after),
            ] {
                if digest.len() != crate::memory::DIGEST_BYTES {
                    return refused(
                        RefusalKind::InvalidArgument,
                        format!(
                            "{field}: a completed memory pass carries a SHA-256 digest of {} bytes (got {})",
                            crate::memory::DIGEST_BYTES,
                            digest.len()
                        ),
                    );
                }
            }
        }
        let queue = self.queues.get_mut(&agent).expect("queue exists");
        queue.active = None;
        let mut memory_outcome = None;
        let mut notice_owed = false;
        if requeue {
            let mut item = active.item;
            item.resume_after_restart = true;
            queue.push_front(item);
        } else {
            self.remember_settled(at, &agent, &active.item.id);
            if is_memory_pass {
                memory_outcome = Some(Box::new(self.record_memory_outcome(at, &agent, &active.item, request)));
            } else if outcome == proto::WakeOutcome::Failed {
                notice_owed = self.owe_failure_notice(at, &agent, &active.item);
            }
        }
        Verdict::Finished { item_id: request.item_id.clone(), requeued: requeue, notice_owed, memory_outcome }
    }
}

fn describe_cursor(cursor: Option<u64>) -> String {
    cursor.map_or_else(|| "absent".to_owned(), |c| c.to_string())
}
