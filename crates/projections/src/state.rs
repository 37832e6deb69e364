//! The projection state: everything decisions need, as ordered tables keyed for checkpoints.
//!
//! Every table is a [`Table`] that remembers changed keys; the runner persists only those, each
//! under a one-byte table tag plus the postcard encoding of its key. The canonical encoding of
//! the whole state (tables in tag order, entries in key order) is what "byte-identical" means
//! in the determinism tests and in `replay verify`.

use serde::{Deserialize, Serialize};

use crate::changes::{EncodedChanges, StateChanges};
use crate::cold::{Cold, ColdTable};
use crate::intern::{AgentInterner, AgentKey, SurfaceKey};
use crate::journal::SurfaceJournal;
use crate::linear::{LinearResponse, LinearResponseKey};
use crate::memory::{MemoryConfig, MemoryGate, OpenPass};
use crate::subscription::Subscription;
use crate::surface::{ChatKind, SurfaceId};
use crate::table::Table;
use crate::verdict::Verdict;
use crate::wake::{AgentQueue, WakeItem};

/// Version of the fold: state layout, its checkpoint layout (16: slot pages, see
/// [`crate::slot_page`]; 17: 16 slots to a page instead of 64; 18: cursors keyed by (surface,
/// agent) and checkpointed in pages of surfaces; 19: subscriptions and the windows of Linear
/// receipts, sessions and responses are cold tables, left in the store at a restore; a session
/// is forgotten by its place among session receipts, not among distinct sessions; 20: the
/// surface interner, the journal headers and the cursors are cold tables; 21: the chat kinds and
/// the DM members are cold tables; 22: 4 slots to a page instead of 16) and decision rules. A checkpoint taken by another version is
/// discarded and state is rebuilt from the log.
pub const FOLD_VERSION: u32 = 22;
/// The highest `min_reader_version` this fold understands. An event that demands more and that
/// the fold cannot read stops all deciding (fail closed).
pub const READER_VERSION: u32 = 1;
/// Verdicts kept: those of the newest this many log sequences. A handler reads its verdict right
/// after the fold applied its request; a retry long after gets the same answer only within this
/// window.
pub const VERDICTS_KEPT_MAX: usize = 65_536;
/// Message identities remembered per surface for dedupe, on top of the log's own window.
pub const IDENTITIES_PER_SURFACE_MAX: u64 = 5_000;

/// Where an event sits in the log: its sequence and the log's timestamp (unix ns).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct LogPosition {
    pub seq: u64,
    pub at_ns: i64,
}

/// Progress of the fold and whether it stopped deciding.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoldMeta {
    pub applied_seq: u64,
    /// Log time of the newest applied event, made monotonic.
    pub last_at_ns: i64,
    /// Set when an event could not be understood safely: the fold applies nothing after it.
    pub halted: Option<Halt>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Halt {
    pub seq: u64,
    pub reason: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentRecord {
    pub slack_bot_user_id: String,
    pub slack_bot_id: String,
    pub display_name: String,
    /// The agent's user id on the generic chat platform (empty: none).
    pub chat_user_id: String,
    pub registered_seq: u64,
}

/// A kept verdict: as the fold recorded it, or as a restored checkpoint holds it (its encoded
/// bytes), decoded the first time it is read. A restart then decodes none of the
/// [`VERDICTS_KEPT_MAX`] kept verdicts up front: measured on a 1.6M-event history, they were half
/// of what a restore took, and most of them are never read again.
///
/// Shared, not copied: a checkpoint takes the kept verdicts of its changed pages
/// ([`State::take_changes`]) and encodes them after the fold moved on, so taking one is a
/// reference count, not a copy of the verdict.
#[derive(Clone, Debug)]
pub struct KeptVerdict(std::sync::Arc<Kept>);

#[derive(Clone, Debug)]
enum Kept {
    /// As the fold recorded it.
    Recorded(Verdict),
    /// As a checkpoint holds it; decoded (or found not to decode) on the first read.
    Stored { bytes: Box<[u8]>, decoded: std::sync::OnceLock<Option<Verdict>> },
}

impl KeptVerdict {
    pub fn new(verdict: Verdict) -> Self {
        KeptVerdict(std::sync::Arc::new(Kept::Recorded(verdict)))
    }

    fn stored(bytes: &[u8]) -> Self {
        KeptVerdict(std::sync::Arc::new(Kept::Stored { bytes: bytes.into(), decoded: std::sync::OnceLock::new() }))
    }

    /// The verdict's checkpoint encoding: the bytes it was restored from, else its encoding.
    fn encoded(&self) -> std::borrow::Cow<'_, [u8]> {
        match &*self.0 {
            Kept::Recorded(verdict) => std::borrow::Cow::Owned(encode(verdict)),
            Kept::Stored { bytes, .. } => std::borrow::Cow::Borrowed(bytes),
        }
    }

    /// The verdict. `None` only for checkpoint bytes that do not decode: such a verdict counts
    /// as not kept (a request retried after it is answered as one whose verdict left the window)
    /// rather than being guessed.
    pub fn get(&self) -> Option<&Verdict> {
        match &*self.0 {
            Kept::Recorded(verdict) => Some(verdict),
            Kept::Stored { bytes, decoded } => {
                decoded.get_or_init(|| decode::<Verdict>("verdicts", bytes).ok()).as_ref()
            }
        }
    }
}

/// Kept verdicts compare by what they say, decoded or not.
impl PartialEq for KeptVerdict {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl Eq for KeptVerdict {}

/// Keys of per-(agent, surface) tables.
pub type AgentSurface = (AgentKey, SurfaceKey);
/// The cursors' key: surface first, so that the cursors on one surface share a checkpoint-key
/// prefix.
pub type SurfaceAgent = (SurfaceKey, AgentKey);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub meta: FoldMeta,
    pub agents: Table<String, AgentRecord>,
    /// Slack bot user ids and bot ids → the agent they belong to.
    pub slack_identities: Table<String, String>,
    /// Surface → its interned key (the key of every surface-keyed table), for every surface the
    /// fold wrote state for ([`crate::intern`]). Cold.
    pub surface_keys: ColdTable<SurfaceId, SurfaceKey>,
    /// Interned key → its surface. Cold.
    pub surface_ids: ColdTable<SurfaceKey, SurfaceId>,
    /// Surfaces interned so far, ever: the next key.
    pub surface_count: Table<(), u32>,
    /// Agents the fold wrote per-(agent, surface) state for, by interned key.
    pub agent_keys: AgentInterner,
    /// Per-surface journal headers (tail, trailing run). Cold: exact for ever, in the store
    /// when idle.
    pub journals: ColdTable<SurfaceKey, SurfaceJournal>,
    /// (surface, ordinal) → the row's metadata, for the newest [`crate::journal::RECENT_ROWS_MAX`]
    /// rows of each surface. Cold: rows of idle surfaces leave memory under the budget.
    pub journal_rows: ColdTable<(SurfaceKey, u64), crate::journal::RowMeta, RowSlots>,
    /// (surface, ts) → ordinal, the dedupe window of message identities. Cold.
    pub identities: ColdTable<(SurfaceKey, crate::surface::Id), u64>,
    /// (surface, ordinal) → (ordinal, ts), to evict the oldest identity of a surface. Cold.
    pub identity_order: ColdTable<(SurfaceKey, u64), (u64, crate::surface::Id), IdentitySlots>,
    /// (surface, agent) → the agent's cursor on the surface: rows 1..=N delivered. Absent key:
    /// no cursor. Read and moved through [`State::cursor_by_key`] and `State::advance_cursor`.
    /// Cold: exact for ever, in the store when idle.
    pub cursors: ColdTable<SurfaceAgent, u64>,
    pub queues: Table<String, AgentQueue>,
    /// (agent, item id) → its newest settle order and when it settled: the duplicate check of
    /// new wakes ([`crate::wake::SettledId`]). Cold.
    pub settled_ids: ColdTable<(AgentKey, String), crate::wake::SettledId>,
    /// (agent, settle order) → (order, item id), the window of the agent's newest settles, to
    /// forget the oldest. Cold.
    pub settled_order: ColdTable<(AgentKey, u64), (u64, String), crate::wake::SettledSlots>,
    pub verdicts: crate::verdict_window::VerdictWindow,
    /// (agent, channel or thread surface) → membership, follow, mute and attention counters.
    /// Cold: every mention starts a thread the agent follows, so this table grows with the
    /// history; the subscriptions of idle threads leave memory under the budget.
    pub subscriptions: ColdTable<AgentSurface, Subscription>,
    /// Chat user ids → the agent they belong to.
    pub chat_identities: Table<String, String>,
    /// A chat's top-level surface → whether it is one-to-one, as its newest observation said.
    /// A chat id does not tell; p2p chats behave like DMs. Cold: one entry per chat ever seen.
    pub chat_kinds: ColdTable<SurfaceKey, ChatKind>,
    /// Linear receipt ids → the log seq of the first receipt (first receipt wins). Cold.
    pub linear_receipts: ColdTable<String, u64>,
    /// Receipt number → (number, receipt id), the window of the newest receipts, to forget the
    /// oldest beyond the bound. Cold.
    pub linear_receipt_order: ColdTable<u64, (u64, String), crate::linear::ReceiptSlots>,
    /// Receipts remembered so far, ever: the number of the next one.
    pub linear_receipt_count: Table<(), u64>,
    /// Linear responses by key: (agent, sorted input ids, hash of kind and body). Cold.
    pub linear_responses: ColdTable<LinearResponseKey, LinearResponse>,
    /// Activity id → the key of its response, for outcomes. Cold.
    pub linear_activities: ColdTable<String, LinearResponseKey>,
    /// Response number → (number, response key), the window of the newest responses, to
    /// forget the oldest beyond the bound. Cold.
    pub linear_response_order: ColdTable<u64, (u64, LinearResponseKey), crate::linear::ResponseSlots>,
    /// Responses remembered so far, ever: the number of the next one.
    pub linear_response_count: Table<(), u64>,
    /// The responses whose outcome is unknown, by key → their activity id: while one is, a
    /// different response to the same inputs is refused (looked up by a range of the key).
    pub linear_unknown_responses: Table<LinearResponseKey, String>,
    /// (agent, session id) → whether the agent received that Linear session and whether it was
    /// stopped since: only a received, unstopped session may be answered.
    /// Cold.
    pub linear_sessions: ColdTable<(String, String), crate::linear::LinearSessionReceived>,
    /// Number of a session receipt → (number, its key), the window of the newest receipts, to
    /// forget the oldest beyond the bound. Cold.
    pub linear_session_order: ColdTable<u64, (u64, (String, String)), crate::linear::SessionSlots>,
    /// Session receipts so far, ever: the number of the next one.
    pub linear_session_count: Table<(), u64>,
    /// The newest `memoryCoherence` configuration in the log (absent: the defaults).
    pub memory_config: Table<(), MemoryConfig>,
    /// Agent → its memory-pass gate: newest history, newest outcome, last window-day queued.
    pub memory_gates: Table<String, MemoryGate>,
    /// Pass id → the memory passes queued or running, fleet-wide: what `maxConcurrent` counts.
    pub memory_open: Table<String, OpenPass>,
    /// Send event id → the post it allowed, once confirmed naming that send: a repeated send
    /// answers "already posted". The newest [`crate::send_hold::POSTED_SENDS_MAX`].
    pub posted_sends: Table<String, crate::send_hold::PostedSend>,
    /// Log seq of the confirmation → send event id, to forget the oldest beyond the bound.
    pub posted_send_order: Table<u64, String>,
    /// (agent, log seq of the finish) → a failure notice the agent owes the person who asked.
    pub notices_owed: Table<(String, u64), crate::failure_notice::OwedNotice>,
    /// The do-not-contact lists in the log (absent: never configured).
    pub do_not_contact: Table<(), crate::do_not_contact::DoNotContact>,
    /// A DM's top-level surface → its other member (the person who writes in it), for the
    /// do-not-contact check. Cold: one entry per DM ever written in.
    pub dm_members: ColdTable<SurfaceKey, String>,
    /// Where entries of the cold tables that left memory are read back from.
    pub cold: Cold,
}

/// What one entry of a cold table takes in memory, by table (key, value, their heap parts and the
/// map's share), for [`State::memory_estimate_bytes`]. Measured with a counting allocator
/// (`benches/state_memory.rs`: each table dropped alone, on the benchmarks' generated mix of
/// 100,000 events), rounded; the tables that mix does not fill (Linear, chat kinds, DM members)
/// are counted at [`COLD_ENTRY_BYTES_UNMEASURED`]. A map's share of an entry depends on how full
/// its table is (its capacity doubles), so a table's figure moves with its length.
fn cold_entry_bytes(tag: u8) -> usize {
    match tag {
        JOURNAL_ROWS_TAG => 230,
        IDENTITIES_TAG | IDENTITY_ORDER_TAG => 98,
        JOURNALS_TAG => 130,
        SURFACE_KEYS_TAG | SURFACE_IDS_TAG => 183,
        CURSORS_TAG => 67,
        SUBSCRIPTIONS_TAG => 211,
        SETTLED_IDS_TAG => 187,
        SETTLED_ORDER_TAG => 173,
        _ => COLD_ENTRY_BYTES_UNMEASURED,
    }
}
/// What an entry of a cold table the counting allocator has not measured is counted at (and
/// every cold entry was, before the tables were measured).
const COLD_ENTRY_BYTES_UNMEASURED: usize = 192;
/// What one known-absent key of a cold table takes, roughly (the key, an empty value and its
/// index slot): a lookup that found nothing, or a removal not yet written, keeps one until the
/// clock's hand passes it unused.
const KNOWN_ABSENT_BYTES: usize = 96;
/// What one fingerprint of an entry a cold table let go of takes, roughly (see
/// [`crate::cold::ColdTable`]): 12.6 bytes a key for 6M keys, counted by a counting allocator
/// (`FingerprintCount`).
const COUNTED_LET_GO_BYTES: usize = 13;
/// What one entry of any other table takes, roughly (queued wakes and verdicts are counted
/// apart).
const HOT_ENTRY_BYTES: usize = 160;
/// What one queued or active wake takes (its item, trigger row and surfaces, and the queue's
/// indexes): 932 bytes measured like [`cold_entry_bytes`].
const QUEUED_WAKE_BYTES: usize = 930;
/// What one kept verdict takes: 336 bytes measured like [`cold_entry_bytes`] (a held send keeps
/// the rows it missed).
const VERDICT_BYTES: usize = 336;

/// Journal rows are checkpointed in slots of the window ([`crate::cold::Slots`]): the row that
/// enters a surface's window overwrites the one that leaves it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowSlots;

impl crate::cold::Slots<(SurfaceKey, u64), crate::journal::RowMeta> for RowSlots {
    fn slot(&(surface, ordinal): &(SurfaceKey, u64)) -> (SurfaceKey, u64) {
        (surface, ordinal % crate::journal::RECENT_ROWS_MAX as u64)
    }
    fn holds(&(_, ordinal): &(SurfaceKey, u64), row: &crate::journal::RowMeta) -> bool {
        row.ordinal == ordinal
    }
    fn key_of((surface, _): (SurfaceKey, u64), row: &crate::journal::RowMeta) -> (SurfaceKey, u64) {
        (surface, row.ordinal)
    }
}

/// The order of a surface's dedupe window is checkpointed in slots of the window likewise.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdentitySlots;

impl crate::cold::Slots<(SurfaceKey, u64), (u64, crate::surface::Id)> for IdentitySlots {
    fn slot(&(surface, ordinal): &(SurfaceKey, u64)) -> (SurfaceKey, u64) {
        (surface, ordinal % IDENTITIES_PER_SURFACE_MAX)
    }
    fn holds(&(_, ordinal): &(SurfaceKey, u64), &(stored, _): &(u64, crate::surface::Id)) -> bool {
        stored == ordinal
    }
    fn key_of((surface, _): (SurfaceKey, u64), &(ordinal, _): &(u64, crate::surface::Id)) -> (SurfaceKey, u64) {
        (surface, ordinal)
    }
}

/// A checkpoint entry that does not decode: the checkpoint is unusable, rebuild from the log.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint entry does not decode ({table}): {reason}")]
pub struct CheckpointDecodeError {
    pub table: &'static str,
    pub reason: String,
}

const META_TAG: u8 = 0;

/// One table's changed entries, copied out of it: each key under its own checkpoint key, or
/// (`paged`) the pages of its changed keys ([`crate::page`]).
macro_rules! take_table {
    ($table:expr, $tag:expr, $changes:ident) => {
        $changes.push(crate::changes::Keyed {
            tag: $tag,
            entries: $table.drain_changes().into_iter().map(|(key, value)| (key, value.cloned())).collect(),
        });
    };
    ($table:expr, $tag:expr, $changes:ident, paged) => {{
        use crate::page::PagedTable;
        let pages: Vec<_> = $table
            .drain_changed_pages()
            .into_iter()
            .map(|page| {
                let entries: Vec<_> =
                    $table.page_entries(page).into_iter().map(|(key, value)| (key.clone(), value.clone())).collect();
                (page, entries)
            })
            .collect();
        $changes.push(crate::changes::Paged { tag: $tag, pages });
    }};
}

/// Decodes one checkpoint entry of a table written by [`take_table`] into `$decoded`.
macro_rules! decode_table_entry {
    ($decoded:ident, $name:expr, $key:expr, $value:expr) => {
        $decoded.push((decode($name, $key)?, decode($name, $value)?))
    };
    ($decoded:ident, $name:expr, $key:expr, $value:expr, paged) => {{
        let _page: u32 = decode($name, $key)?;
        let entries: Vec<(_, _)> = decode($name, $value)?;
        $decoded.extend(entries);
    }};
}

macro_rules! state_tables {
    ($($tag:literal => $field:ident $($paged:ident)?),* $(,)?; cold: $($ctag:ident => $cfield:ident),* $(,)?) => {
        impl State {
            /// Changed entries since the last call, copied out of the state and not yet encoded
            /// ([`crate::changes`]): what a checkpoint writes. The fold meta is always included.
            pub fn take_changes(&mut self) -> StateChanges {
                self.cold.note_taken();
                let mut changes = StateChanges::default();
                changes.push(crate::changes::Single { key: vec![META_TAG], value: self.meta.clone() });
                $(
                    take_table!(self.$field, $tag, changes $(, $paged)?);
                )*
                $(
                    changes.push(self.$cfield.take_changes($ctag));
                )*
                // Verdicts in pages of their window's slots (seq modulo the window): the newest
                // takes the slot of the one it pushes out, and a page is written whole.
                let mut pages = Vec::new();
                for page in self.verdicts.drain_changed_pages() {
                    let entries: Vec<_> =
                        self.verdicts.page(page).into_iter().map(|(seq, kept)| (seq, VerdictBytes(kept))).collect();
                    pages.push((page, entries));
                }
                changes.push(crate::changes::Paged { tag: VERDICTS_TAG, pages });
                // A queue: its header, and each item that changed under its own key.
                let mut queues = QueueChanges::default();
                self.queues.drain_changes_mut(|agent, queue| {
                    let Some(queue) = queue else { return };
                    let items = queue.drain_item_changes();
                    queues.entries += 1 + items.len();
                    queues.queues.push((agent.clone(), queue.header(), items));
                });
                changes.push(queues);
                changes
            }

            /// Changed entries since the last call, as (key, value) bytes; `None` removes the key.
            /// The fold meta is always included.
            pub fn drain_changes(&mut self) -> EncodedChanges {
                self.take_changes().encode()
            }

            /// Loads one checkpoint entry written by [`State::drain_changes`].
            pub fn load_entry(&mut self, key: &[u8], value: &[u8]) -> Result<(), CheckpointDecodeError> {
                let (tag, rest) = key.split_first().ok_or_else(|| CheckpointDecodeError {
                    table: "?",
                    reason: "empty key".into(),
                })?;
                match *tag {
                    META_TAG => self.meta = decode("meta", value)?,
                    $(
                        $tag => self.load_table_entries($tag, &[(key, value)])?,
                    )*
                    $(
                        $ctag => self.$cfield.load(decode(stringify!($cfield), rest)?, decode(stringify!($cfield), value)?),
                    )*
                    VERDICTS_TAG => {
                        // Only the seqs are decoded here: each verdict waits in its bytes until
                        // it is read (most kept verdicts never are after a restart).
                        let _page: u64 = decode("verdicts", rest)?;
                        let entries: Vec<(u64, &[u8])> = decode_borrowed("verdicts", value)?;
                        for (seq, verdict) in entries {
                            self.verdicts.load(seq, KeptVerdict::stored(verdict));
                        }
                    }
                    QUEUES_TAG => {
                        let agent: String = decode("queues", rest)?;
                        self.queues.load_mut(agent).load_header(decode("queues", value)?);
                    }
                    QUEUE_ITEMS_TAG => {
                        let (agent, slot): (String, [u8; 8]) = decode("queue_items", rest)?;
                        self.queues.load_mut(agent).load_item(u64::from_be_bytes(slot), decode("queue_items", value)?);
                    }
                    other => {
                        return Err(CheckpointDecodeError { table: "?", reason: format!("unknown table tag {other}") })
                    }
                }
                Ok(())
            }

            /// Loads every checkpoint entry of the table with tag `tag` at once (each key as for
            /// [`State::load_entry`], tag first): an ordered table still empty is built from them
            /// in one pass rather than by one insert each (those inserts were a fifth of a
            /// restore's CPU at the scale figure's history). Other tags load entry by entry; an
            /// ordered table's single entry comes here from [`State::load_entry`] too, so its
            /// entries are decoded in one place.
            pub fn load_table_entries<Key: AsRef<[u8]>, Value: AsRef<[u8]>>(
                &mut self,
                tag: u8,
                entries: &[(Key, Value)],
            ) -> Result<(), CheckpointDecodeError> {
                match tag {
                    $(
                        $tag => {
                            let mut decoded = Vec::with_capacity(entries.len());
                            for (key, value) in entries {
                                let rest = key.as_ref().get(1..).unwrap_or_default();
                                decode_table_entry!(decoded, stringify!($field), rest, value.as_ref() $(, $paged)?);
                            }
                            self.$field.load_batch(decoded);
                        }
                    )*
                    _ => {
                        for (key, value) in entries {
                            self.load_entry(key.as_ref(), value.as_ref())?;
                        }
                    }
                }
                Ok(())
            }

            /// The canonical encoding of the whole state: equal states give equal bytes.
            pub fn canonical_bytes(&self) -> Vec<u8> {
                let mut out = Vec::new();
                self.canonical_encode(&mut |chunk| out.extend_from_slice(chunk));
                out
            }

            /// The bytes of [`State::canonical_bytes`], handed to `sink` in chunks of about
            /// [`CANONICAL_CHUNK_BYTES`]: a digest of the state (`Replay.StateAt` answers with
            /// one) needs no buffer of the whole state, and no value is encoded into a buffer of
            /// its own.
            pub fn canonical_encode(&self, sink: &mut dyn FnMut(&[u8])) {
                let mut out = CanonicalWriter { chunk: Vec::with_capacity(2 * CANONICAL_CHUNK_BYTES), sink };
                out.put(&self.meta);
                $(
                    out.byte($tag);
                    out.put(&(self.$field.len() as u64));
                    for (key, value) in self.$field.iter() {
                        out.put(key);
                        out.put(value);
                    }
                )*
                out.byte(VERDICTS_TAG);
                out.put(&(self.verdicts.len() as u64));
                for (seq, kept) in self.verdicts.iter() {
                    out.put(&seq);
                    out.put(&kept.get());
                }
                out.byte(QUEUES_TAG);
                out.put(&(self.queues.len() as u64));
                for (agent, queue) in self.queues.iter() {
                    out.put(agent);
                    out.put(&queue.header());
                    out.put(&(queue.queued_len() as u64));
                    if queue.items_in_store() {
                        for (slot, item) in self.stored_queue_items(agent) {
                            out.put(&slot);
                            out.put(&item);
                        }
                    } else {
                        for (slot, item) in queue.slotted() {
                            out.put(&slot);
                            out.put(item);
                        }
                    }
                }
                $(
                    self.$cfield.with_sorted_entries($ctag, &self.cold, |entries| {
                        out.byte($ctag);
                        out.put(&(entries.len() as u64));
                        for (key, value) in entries {
                            out.put(*key);
                            out.put(*value);
                        }
                    });
                )*
                out.finish();
            }

            /// Entries not yet checkpointed.
            pub fn changed_len(&self) -> usize {
                0 $(+ self.$field.changed_len())* $(+ self.$cfield.changed_len())* + self.verdicts.changed_len()
                    + self.queues.changed_len()
                    + self.queues.iter().map(|(_, queue)| queue.changed_items_len()).sum::<usize>()
            }

            /// Whether entries of the table with this checkpoint tag may stay in the store when
            /// a checkpoint is restored (they are read back when needed).
            pub fn is_cold_tag(tag: u8) -> bool {
                [$($ctag,)* QUEUE_ITEMS_TAG].contains(&tag) || crate::slot_page::is_page_tag(tag)
            }

            /// Backs the cold tables with `cold`. `restored`: the state was restored from a
            /// checkpoint without its cold entries, so entries not in memory are read from the
            /// store. Otherwise the store holds nothing of this state yet and every table stays
            /// complete (a key not in memory is absent, with no read) until entries leave memory.
            pub fn attach_cold(&mut self, cold: Cold, restored: bool) {
                self.cold = cold;
                if restored {
                    $( self.$cfield.set_backed(); )*
                    self.queues.load_each_mut(|_, queue| queue.leave_items_in_store());
                }
            }

            /// Lets go of up to `max` clean entries of the cold tables (see [`crate::cold`]),
            /// shared among them in proportion to the keys each holds in memory, present or
            /// known absent, so that every table's hand comes round at the same pace and takes
            /// the known-absent keys it passes with it (shared by present entries alone, tables
            /// of many lookups that found nothing or removals, such as the settled ids, got
            /// slices too small to pass theirs: after 180 s of `anima-load` 793,000 known-absent
            /// keys against 289,000). Only while the store holds every clean entry's latest
            /// value. Returns how many present entries left memory.
            pub fn evict_cold(&mut self, max: usize) -> usize {
                let keys = self.cold_keys_len();
                let share = |table_keys: usize| {
                    if max >= keys {
                        max
                    } else {
                        // At least one each, so a small table is not passed over for ever.
                        ((max as u128 * table_keys as u128).div_ceil(keys as u128) as usize).max(1)
                    }
                };
                0 $(+ { let max = share(self.$cfield.slots_len()); self.$cfield.evict(max) })*
            }

            /// Present entries of the cold tables in memory.
            pub fn cold_resident_len(&self) -> usize {
                0 $(+ self.$cfield.resident_len())*
            }

            /// What the present entries of the cold tables take in memory, by the estimate.
            pub fn cold_resident_bytes(&self) -> usize {
                0 $(+ self.$cfield.resident_len() * cold_entry_bytes($ctag))*
            }

            /// Keys of the cold tables in memory, present or known absent.
            pub fn cold_keys_len(&self) -> usize {
                0 $(+ self.$cfield.slots_len())*
            }

            /// Fingerprints the cold tables keep of entries they let go of.
            pub fn cold_counted_len(&self) -> usize {
                0 $(+ self.$cfield.let_go_len())*
            }

            /// The name of the table with this tag.
            pub fn table_of_tag(tag: u8) -> Option<&'static str> {
                match tag {
                    $( $tag => Some(stringify!($field)), )*
                    $( $ctag => Some(stringify!($cfield)), )*
                    META_TAG => Some("meta"),
                    QUEUES_TAG => Some("queues"),
                    VERDICTS_TAG => Some("verdicts"),
                    QUEUE_ITEMS_TAG => Some("queue_items"),
                    _ => None,
                }
            }
        }
    };
}

state_tables! {
    1 => agents,
    2 => slack_identities,
    // 3 and 6 held the journal headers and the cursors, and 22 the surface interner, in pages
    // of surfaces before they were cold tables (fold version 20).
    // 9 held the settle order before `settled` kept it in its key.
    12 => chat_identities,
    // 13 and 32 held the chat kinds and the DM members in pages of surfaces before they were
    // cold tables (fold version 21).
    19 => memory_config,
    20 => memory_gates,
    21 => memory_open,
    23 => agent_keys paged,
    28 => posted_sends,
    29 => posted_send_order,
    30 => notices_owed,
    31 => do_not_contact,
    35 => linear_receipt_count,
    36 => linear_session_count,
    37 => linear_response_count,
    38 => linear_unknown_responses,
    41 => surface_count;
    cold:
    SURFACE_KEYS_TAG => surface_keys,
    SURFACE_IDS_TAG => surface_ids,
    JOURNALS_TAG => journals,
    CURSORS_TAG => cursors,
    IDENTITIES_TAG => identities,
    IDENTITY_ORDER_TAG => identity_order,
    JOURNAL_ROWS_TAG => journal_rows,
    SETTLED_IDS_TAG => settled_ids,
    SETTLED_ORDER_TAG => settled_order,
    SUBSCRIPTIONS_TAG => subscriptions,
    LINEAR_RECEIPTS_TAG => linear_receipts,
    LINEAR_RECEIPT_ORDER_TAG => linear_receipt_order,
    LINEAR_SESSIONS_TAG => linear_sessions,
    LINEAR_SESSION_ORDER_TAG => linear_session_order,
    LINEAR_RESPONSES_TAG => linear_responses,
    LINEAR_ACTIVITIES_TAG => linear_activities,
    LINEAR_RESPONSE_ORDER_TAG => linear_response_order,
    CHAT_KINDS_TAG => chat_kinds,
    DM_MEMBERS_TAG => dm_members,
}

/// Queue headers (agent → [`crate::wake::QueueHeader`]) and queued items ((agent, slot) → item).
const QUEUES_TAG: u8 = 7;

/// The changed queues taken for a checkpoint: each one's header and its changed items.
#[derive(Default)]
struct QueueChanges {
    queues: Vec<(String, crate::wake::QueueHeader, Vec<crate::wake::ChangedItem>)>,
    entries: usize,
}

impl crate::changes::ChangesPart for QueueChanges {
    fn entries(&self) -> usize {
        self.entries
    }

    fn encode_into(self: Box<Self>, out: &mut EncodedChanges) {
        for (agent, header, items) in self.queues {
            out.push((tagged(QUEUES_TAG, &agent), Some(encode(&header))));
            for (slot, item) in items {
                out.push((tagged(QUEUE_ITEMS_TAG, &(&agent, slot.to_be_bytes())), item.map(|item| encode(&*item))));
            }
        }
    }
}

/// A kept verdict as its checkpoint encoding (the bytes it was restored from, else its
/// encoding), written as a byte string inside its page.
struct VerdictBytes(KeptVerdict);

impl Serialize for VerdictBytes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        <[u8]>::serialize(&self.0.encoded(), serializer)
    }
}
/// Verdicts: page of slots (seq modulo the window,
/// [`crate::verdict_window::VERDICTS_PER_PAGE`] slots a page) → the
/// (seq, encoded verdict) pairs of the page's slots.
const VERDICTS_TAG: u8 = 10;
pub(crate) const QUEUE_ITEMS_TAG: u8 = 27;
pub(crate) const IDENTITIES_TAG: u8 = 4;
pub(crate) const IDENTITY_ORDER_TAG: u8 = 5;
pub(crate) const SETTLED_IDS_TAG: u8 = 33;
pub(crate) const SETTLED_ORDER_TAG: u8 = 34;
pub(crate) const SUBSCRIPTIONS_TAG: u8 = 11;
pub(crate) const LINEAR_RECEIPTS_TAG: u8 = 14;
pub(crate) const LINEAR_RECEIPT_ORDER_TAG: u8 = 15;
pub(crate) const LINEAR_SESSIONS_TAG: u8 = 24;
pub(crate) const LINEAR_SESSION_ORDER_TAG: u8 = 25;
pub(crate) const LINEAR_RESPONSES_TAG: u8 = 16;
pub(crate) const LINEAR_ACTIVITIES_TAG: u8 = 17;
pub(crate) const LINEAR_RESPONSE_ORDER_TAG: u8 = 18;
use crate::intern::{SURFACE_IDS_TAG, SURFACE_KEYS_TAG};
use crate::journal::{JOURNALS_TAG, JOURNAL_ROWS_TAG};
/// Checkpoint tag of `State::cursors`.
pub(crate) const CURSORS_TAG: u8 = 43;
/// Checkpoint tags of `State::chat_kinds` and `State::dm_members`.
pub(crate) const CHAT_KINDS_TAG: u8 = 44;
pub(crate) const DM_MEMBERS_TAG: u8 = 45;

/// What [`State::canonical_encode`] gathers before handing bytes on.
pub const CANONICAL_CHUNK_BYTES: usize = 64 * 1024;

/// Encodes values one after another into one reused chunk, handed to the sink when full.
struct CanonicalWriter<'a> {
    chunk: Vec<u8>,
    sink: &'a mut dyn FnMut(&[u8]),
}

impl CanonicalWriter<'_> {
    fn put<T: Serialize + ?Sized>(&mut self, value: &T) {
        let chunk = std::mem::take(&mut self.chunk);
        // Serializing plain data into a Vec cannot fail.
        self.chunk = postcard::to_extend(value, chunk).expect("postcard encodes plain data");
        if self.chunk.len() >= CANONICAL_CHUNK_BYTES {
            (self.sink)(&self.chunk);
            self.chunk.clear();
        }
    }

    fn byte(&mut self, byte: u8) {
        self.chunk.push(byte);
    }

    fn finish(self) {
        if !self.chunk.is_empty() {
            (self.sink)(&self.chunk);
        }
    }
}

pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // Serializing plain data into a Vec cannot fail.
    postcard::to_allocvec(value).expect("postcard encodes plain data")
}

pub(crate) fn tagged<T: Serialize>(tag: u8, key: &T) -> Vec<u8> {
    let mut out = vec![tag];
    out.extend(encode(key));
    out
}

fn decode<T: for<'de> Deserialize<'de>>(table: &'static str, bytes: &[u8]) -> Result<T, CheckpointDecodeError> {
    decode_borrowed(table, bytes)
}

/// [`decode`] into a value that borrows from `bytes`.
fn decode_borrowed<'a, T: Deserialize<'a>>(table: &'static str, bytes: &'a [u8]) -> Result<T, CheckpointDecodeError> {
    postcard::from_bytes(bytes).map_err(|e| CheckpointDecodeError { table, reason: e.to_string() })
}

impl State {
    pub fn new() -> Self {
        State::default()
    }

    /// The verdict recorded for the event at `seq`, if still kept.
    pub fn verdict(&self, seq: u64) -> Option<&Verdict> {
        self.verdicts.get(seq).and_then(KeptVerdict::get)
    }

    pub fn cursor(&self, agent: &str, surface: &SurfaceId) -> Option<u64> {
        self.cursor_by_key(self.agent_keys.key(agent)?, self.surface_key(surface)?)
    }

    /// The cursor of (agent, surface), read from the store without keeping it if it left memory.
    pub(crate) fn cursor_by_key(&self, agent: AgentKey, surface: SurfaceKey) -> Option<u64> {
        self.cursors.get_or_read(CURSORS_TAG, &(surface, agent), &self.cold).map(|cursor| *cursor)
    }

    /// The journal header of `surface`, read from the store without keeping it if it left memory.
    pub fn journal(&self, surface: &SurfaceId) -> Option<SurfaceJournal> {
        self.journal_by_key(self.surface_key(surface)?).map(std::borrow::Cow::into_owned)
    }

    /// Surfaces with a journal, in memory or in the store (for tools).
    pub fn journals_len(&self) -> usize {
        self.journals.total_len(JOURNALS_TAG, &self.cold)
    }

    /// Cursors, in memory or in the store (for tools).
    pub fn cursors_len(&self) -> usize {
        self.cursors.total_len(CURSORS_TAG, &self.cold)
    }

    /// Every cursor as ((agent, surface), cursor), in agent then surface order, in memory or in
    /// the store (for tools: reads the whole table).
    pub fn cursor_entries(&self) -> Vec<((String, SurfaceId), u64)> {
        let mut entries: Vec<_> = self
            .cursors
            .all_entries(CURSORS_TAG, &self.cold)
            .into_iter()
            .map(|((surface, agent), cursor)| {
                ((self.agent_keys.value(agent).clone(), self.surface_of(surface).expect("an interned surface")), cursor)
            })
            .collect();
        entries.sort();
        entries
    }

    /// Every journal with its surface, in surface order, in memory or in the store (for tools:
    /// reads the whole table).
    pub fn journal_entries(&self) -> Vec<(SurfaceId, SurfaceJournal)> {
        let mut entries: Vec<_> = self
            .journals
            .all_entries(JOURNALS_TAG, &self.cold)
            .into_iter()
            .map(|(surface, journal)| (self.surface_of(surface).expect("an interned surface"), journal))
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    pub fn queue(&self, agent: &str) -> Option<&AgentQueue> {
        self.queues.get(agent)
    }

    /// Brings the agent's queued items into memory if a restore left them in the checkpoint
    /// store (one scan of the agent's entries); every fold path that reads or changes a queue's
    /// items calls it first. They stay in memory from then on, like every queue that was never
    /// restored.
    pub(crate) fn ensure_queue(&mut self, agent: &str) {
        if !self.queues.get(agent).is_some_and(AgentQueue::items_in_store) {
            return;
        }
        let items = self.stored_queue_items(agent);
        self.queues.load_mut(agent.to_owned()).load_stored_items(items);
    }

    /// The agent's waiting items, in queue order, read from the store for a queue whose items
    /// a restore left there (nothing is kept): for readers outside the fold.
    pub fn queued_items(&self, agent: &str) -> Vec<WakeItem> {
        match self.queues.get(agent) {
            Some(queue) if queue.items_in_store() => {
                self.stored_queue_items(agent).into_iter().map(|(_, item)| item).collect()
            }
            Some(queue) => queue.queued().cloned().collect(),
            None => Vec::new(),
        }
    }

    /// The agent's items as the checkpoint store holds them, by slot.
    fn stored_queue_items(&self, agent: &str) -> Vec<(u64, WakeItem)> {
        self.cold
            .scan(&tagged(QUEUE_ITEMS_TAG, &agent))
            .into_iter()
            .map(|(key, value)| {
                let stored = || -> Result<(u64, WakeItem), CheckpointDecodeError> {
                    let (_, slot): (String, [u8; 8]) = decode("queue_items", &key[1..])?;
                    Ok((u64::from_be_bytes(slot), decode("queue_items", &value)?))
                };
                stored().unwrap_or_else(|e| panic!("a queued item in the checkpoint store: {e}"))
            })
            .collect()
    }

    /// Whether the surface is a direct conversation (a Slack DM, or a thread or the top level of
    /// a chat last observed as p2p): routed as `dm`, no follows, cannot be muted.
    pub fn is_direct(&self, surface: &SurfaceId) -> bool {
        match surface {
            SurfaceId::Slack { .. } => surface.is_slack_dm(),
            SurfaceId::Chat { .. } => self.surface_key(&surface.top_level()).is_some_and(|chat| {
                self.chat_kinds.get_or_read(CHAT_KINDS_TAG, &chat, &self.cold).as_deref() == Some(&ChatKind::P2p)
            }),
            SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => false,
        }
    }

    /// A checkpoint key of a table keyed by interned surfaces or agents, with those named by
    /// their ids (e.g. `subscriptions (ada, slack:T1:D1)`), for reports that point at a key. `None` for
    /// other tables and for keys that do not decode or that this state never assigned.
    pub fn describe_interned_key(&self, key: &[u8]) -> Option<String> {
        let (tag, rest) = key.split_first()?;
        let table = Self::table_of_tag(*tag)?;
        let surface = |key: SurfaceKey| self.surface_of(key).map(|surface| surface.to_string());
        let agent = |key: AgentKey| self.agent_keys.get(key).cloned();
        let named = match table {
            "chat_kinds" | "dm_members" => surface(postcard::from_bytes(rest).ok()?)?,
            "identities" => {
                let (on, ts): (SurfaceKey, String) = postcard::from_bytes(rest).ok()?;
                format!("({}, {ts})", surface(on)?)
            }
            "identity_order" | "journal_rows" => {
                let (on, ordinal): (SurfaceKey, u64) = postcard::from_bytes(rest).ok()?;
                format!("({}, {ordinal})", surface(on)?)
            }
            "journals" | "surface_ids" => format!("({})", surface(postcard::from_bytes(rest).ok()?)?),
            "cursors" => {
                let (on, of): SurfaceAgent = postcard::from_bytes(rest).ok()?;
                format!("({}, {})", surface(on)?, agent(of)?)
            }
            "subscriptions" => {
                let (of, on): AgentSurface = postcard::from_bytes(rest).ok()?;
                format!("({}, {})", agent(of)?, surface(on)?)
            }
            "agent_keys" => {
                let keys = <AgentKey as crate::page::PageKey>::page_keys(postcard::from_bytes(rest).ok()?);
                format!("page of agents from {}", agent(*keys.start())?)
            }
            _ => return None,
        };
        Some(format!("{table} {named}"))
    }

    /// The state's own estimate of the memory it takes: entries counted by table, with a rough
    /// size each. The runner compares it with its budget to decide when cold entries leave.
    pub fn memory_estimate_bytes(&self) -> usize {
        let queued: usize = self.queues.iter().map(|(_, queue)| queue.resident_len() + 1).sum();
        let hot_entries = self.agents.len()
            + self.slack_identities.len()
            + self.chat_identities.len()
            + self.linear_unknown_responses.len()
            + self.memory_gates.len()
            + self.memory_open.len()
            + self.posted_sends.len() * 2
            + self.notices_owed.len()
            + self.do_not_contact.get(&()).map_or(0, |c| c.lists.values().map(|users| users.len() + 1).sum())
            + self.agent_keys.len();
        let resident = self.cold_resident_len();
        self.cold_resident_bytes()
            + (self.cold_keys_len() - resident) * KNOWN_ABSENT_BYTES
            + self.cold_counted_len() * COUNTED_LET_GO_BYTES
            + hot_entries * HOT_ENTRY_BYTES
            + self.verdicts.len() * VERDICT_BYTES
            + queued * QUEUED_WAKE_BYTES
    }

    /// What one present entry of the cold tables takes on average, by the estimate: what the
    /// runner divides an excess by to know how many entries must leave memory.
    pub fn cold_entry_bytes_mean(&self) -> usize {
        self.cold_resident_bytes().checked_div(self.cold_resident_len()).unwrap_or(COLD_ENTRY_BYTES_UNMEASURED).max(1)
    }

    /// Whether the fold stopped deciding at or before `seq`.
    pub fn halted_at_or_before(&self, seq: u64) -> Option<&Halt> {
        self.meta.halted.as_ref().filter(|h| h.seq <= seq)
    }
}

#[cfg(test)]
mod kept_verdict_tests {
    use super::*;
    use crate::verdict::RefusalKind;

    #[test]
    fn a_restored_verdict_reads_as_recorded_and_damaged_bytes_read_as_not_kept() {
        let recorded = crate::verdict::refused(RefusalKind::InvalidArgument, "agent_id is empty");
        let mut folded = State::new();
        folded.meta.applied_seq = 7;
        folded.verdicts.record(7, KeptVerdict::new(recorded.clone()));
        let changes = folded.drain_changes();
        let (key, bytes) = changes.iter().find(|(key, _)| key[0] == VERDICTS_TAG).expect("a verdict page");
        let mut restored = State::new();
        restored.load_entry(key, bytes.as_deref().expect("a page")).expect("loads");
        assert_eq!(restored.verdict(7), Some(&recorded), "decoded on first read");
        assert_eq!(restored.verdict(7), Some(&recorded), "and the same on the next");
        assert_eq!(restored.verdicts.get(7), Some(&KeptVerdict::new(recorded)));
        let damaged = KeptVerdict::stored(&[0xff, 0xff, 0xff]);
        assert_eq!(damaged.get(), None, "bytes that do not decode are not a verdict");
    }

    /// A page holds the slots of the window's current cycle and of the one before: a verdict
    /// pushed out of the window leaves its page, and a page whose verdicts all left is removed.
    #[test]
    fn verdict_pages_hold_exactly_the_kept_window() {
        let window = VERDICTS_KEPT_MAX as u64;
        let last = (2 * window + 500) / 10 * 10;
        let mut folded = State::new();
        let mut store = std::collections::BTreeMap::new();
        // Every tenth seq records a verdict, across two wraps of the window, with a checkpoint
        // now and then; the store applies each checkpoint's entries.
        for seq in (10..=last).step_by(10) {
            folded.meta.applied_seq = seq;
            let verdict = crate::verdict::refused(RefusalKind::InvalidArgument, format!("event {seq}"));
            folded.verdicts.record(seq, KeptVerdict::new(verdict));
            if seq % 7_000 == 0 || seq == last {
                for (key, value) in folded.drain_changes() {
                    match value {
                        Some(value) => store.insert(key, value),
                        None => store.remove(&key),
                    };
                }
            }
        }
        let mut restored = State::new();
        for (key, value) in &store {
            restored.load_entry(key, value).expect("loads");
        }
        let kept = |state: &State| -> Vec<(u64, Option<Verdict>)> {
            state.verdicts.iter().map(|(seq, kept)| (seq, kept.get().cloned())).collect()
        };
        let (restored_kept, folded_kept) = (kept(&restored), kept(&folded));
        assert_eq!(
            (restored_kept.first().map(|k| k.0), restored_kept.last().map(|k| k.0), restored_kept.len()),
            (folded_kept.first().map(|k| k.0), folded_kept.last().map(|k| k.0), folded_kept.len())
        );
        assert!(restored_kept == folded_kept, "the store holds the kept window, no more");
        let pages = store.keys().filter(|key| key[0] == VERDICTS_TAG).count() as u64;
        assert_eq!(pages, window / crate::verdict_window::VERDICTS_PER_PAGE, "one entry per page of slots");
    }

    /// The canonical encoding reaches its sink in bounded chunks, and the last one is handed
    /// on too: a digest taken as the state is encoded covers every table.
    #[test]
    fn the_canonical_encoding_streams_in_bounded_chunks_to_its_last_table() {
        let mut folded = State::new();
        for seq in 1..=20_000u64 {
            folded.meta.applied_seq = seq;
            let verdict = crate::verdict::refused(RefusalKind::InvalidArgument, format!("event {seq}"));
            folded.verdicts.record(seq, KeptVerdict::new(verdict));
        }
        let mut chunks: Vec<Vec<u8>> = Vec::new();
        folded.canonical_encode(&mut |chunk| chunks.push(chunk.to_vec()));
        assert!(chunks.len() >= 3, "{} chunks", chunks.len());
        let (last, full) = chunks.split_last().expect("chunks");
        for chunk in full {
            let size = chunk.len();
            assert!((CANONICAL_CHUNK_BYTES..CANONICAL_CHUNK_BYTES + 1_024).contains(&size), "a chunk of {size} bytes");
        }
        assert!(!last.is_empty() && last.len() < CANONICAL_CHUNK_BYTES);
        let streamed = chunks.concat();
        assert!(streamed == folded.canonical_bytes());
        // The newest verdict, then the (empty) queues and cold tables, each a tag and a count.
        let newest = encode(&folded.verdict(20_000).cloned().expect("kept"));
        let mut tail = newest;
        for tag in [
            QUEUES_TAG,
            SURFACE_KEYS_TAG,
            SURFACE_IDS_TAG,
            JOURNALS_TAG,
            CURSORS_TAG,
            IDENTITIES_TAG,
            IDENTITY_ORDER_TAG,
            crate::journal::JOURNAL_ROWS_TAG,
            SETTLED_IDS_TAG,
            SETTLED_ORDER_TAG,
            SUBSCRIPTIONS_TAG,
            LINEAR_RECEIPTS_TAG,
            LINEAR_RECEIPT_ORDER_TAG,
            LINEAR_SESSIONS_TAG,
            LINEAR_SESSION_ORDER_TAG,
            LINEAR_RESPONSES_TAG,
            LINEAR_ACTIVITIES_TAG,
            LINEAR_RESPONSE_ORDER_TAG,
            CHAT_KINDS_TAG,
            DM_MEMBERS_TAG,
        ] {
            tail.extend([tag, 0]);
        }
        assert!(streamed.ends_with(&tail), "the encoding ends with the newest verdict and the empty tables");
    }
}
