//! Verdicts: what the fold decided for each event, recorded in state under the event's log
//! sequence. A command handler appends its request, waits until the fold has applied that
//! sequence, and returns the verdict found here — never a decision of its own.

use serde::{Deserialize, Serialize};

use crate::journal::RowMeta;
use crate::subscription::Route;
use crate::surface::SurfaceId;
pub use crate::text::PostKind;
use crate::wake::{NotQueued, PlanEntry, WakeItem, WakeReason};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// A message observation (or a confirmed own post) was folded.
    Journaled(JournalVerdict),
    /// An agent registration was folded.
    AgentRegistered,
    Send(SendVerdict),
    Claim(ClaimVerdict),
    /// The start was accepted; `moved` are the plan's cursor moves (the facts the explanation
    /// renders), `coalesced` other queued items its cursors now cover, settled without a turn.
    Started {
        item_id: String,
        coalesced: Vec<String>,
        moved: Vec<MovedCursor>,
    },
    HeartbeatRecorded,
    /// A silent running wake was re-queued to resume, or a claim never started within its lease
    /// was re-queued (`started: false`) for any worker to claim.
    Recovered {
        item_id: String,
        started: bool,
    },
    SubscriptionChanged {
        surface: SurfaceId,
        muted: bool,
    },
    Finished {
        item_id: String,
        requeued: bool,
        /// A failure notice is now owed to the person who asked for the wake.
        notice_owed: bool,
        /// For a memory pass that did not drain: its recorded outcome.
        memory_outcome: Option<Box<crate::memory::MemoryOutcomeRecord>>,
    },
    /// A configuration event was folded.
    Configured,
    /// A memory pass was queued for the agent.
    MemoryPassQueued {
        agent: String,
        pass_id: String,
        window_day: String,
    },
    /// A Linear session event was folded for its receiving agent.
    LinearSession(LinearSessionVerdict),
    /// A Slack thread stop removed the thread's queued input of its agent.
    ThreadStopped(crate::thread_stop::ThreadStopVerdict),
    /// A Linear response request or outcome was decided: the response's activity id and state.
    LinearResponse(LinearResponseVerdict),
    /// The request was refused. Nothing changed, except that a start refused as stale returns
    /// its item to the front of the queue, so the next claim prepares a fresh plan.
    Refused(Refusal),
}

/// One cursor a decision moved (or left where it was), on one surface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MovedCursor {
    pub surface: SurfaceId,
    pub before: Option<u64>,
    pub after: u64,
    /// The surface's tail at the decision.
    pub tail: u64,
}

/// What happened to one observation for its receiving agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalVerdict {
    pub agent: String,
    /// The surface it belongs to (`None`: not observable, recorded but not journaled).
    pub surface: Option<SurfaceId>,
    /// Its journal ordinal (0: not journaled).
    pub ordinal: u64,
    /// The message identity was already journaled; `ordinal` is the earlier row.
    pub duplicate_message: bool,
    /// The wake it queued for the agent, if any.
    pub wake: Option<WakeReason>,
    /// How routing judged it for the agent (`None`: not journaled or unknown agent). A route
    /// to a wake with `wake: None` says in `not_queued` why it was not queued.
    pub route: Option<Route>,
    /// Why the wake routing earned was not queued: a duplicate item, or a full queue (the agent
    /// was not woken for it).
    pub not_queued: Option<NotQueued>,
    /// A confirmed own post: the failure notices it settled (item ids of the given-up wakes).
    pub notices_settled: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SendVerdict {
    /// Post it. The cursor (if the agent has one on the surface) passed the agent's own rows.
    Allowed { surface: SurfaceId, cursor_before: Option<u64>, cursor_after: Option<u64> },
    /// Foreign messages arrived after the cursor: show them; the cursor passed the tail.
    Held(HeldSend),
    /// Refused before the hold: the post would reach a person on the do-not-contact list (or
    /// the list cannot be checked). No cursor moved.
    NotContacted(crate::do_not_contact::NotContacted),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldSend {
    pub surface: SurfaceId,
    /// What was not sent, as the notice names it.
    pub kind: PostKind,
    pub cursor_before: u64,
    pub tail: u64,
    /// Foreign rows after the cursor: the agent's own rows there are not new to it.
    pub new_messages: u64,
    /// Foreign rows after the cursor not shown (the older ones).
    pub omitted: u64,
    /// The newest foreign rows that fit the budget, oldest first.
    pub shown: Vec<RowMeta>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimVerdict {
    /// Nothing claimable. Items found already delivered were settled on the way.
    Nothing {
        settled_without_turn: Vec<String>,
    },
    Claimed(Box<ClaimedWake>),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimedWake {
    pub item: WakeItem,
    pub worker: String,
    /// Per plan surface: the cursor the start expects and where it moves it.
    pub plan: Vec<PlanEntry>,
    /// Rows shown besides the trigger, in conversation-time order (ts, then log order).
    pub rows: Vec<RowMeta>,
    /// Rows after the cursors that are not shown.
    pub not_shown: u64,
    pub settled_without_turn: Vec<String>,
    /// For a memory pass: the size of `MEMORY.md` the claim reported, in bytes.
    pub memory_md_bytes: u64,
    /// For a memory pass: the configured threshold at the claim's place in the log; a larger
    /// `MEMORY.md` gets the consolidation form.
    pub consolidation_threshold_bytes: u64,
    /// Which of the trigger's extras (note, previews, files) the wake text shows.
    pub extras: crate::text::Extras,
}

/// What one Linear session event did for its receiving agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearSessionVerdict {
    pub agent: String,
    pub session: String,
    /// The receipt id (`None` for a stop, which is no receipt).
    pub receipt: Option<String>,
    /// The receipt was seen before: the first one won, this one woke nothing.
    pub duplicate_receipt: bool,
    /// The wake it queued (`None`: duplicate receipt or item, a full queue, or a stop).
    pub wake: Option<WakeReason>,
    /// Why a receipt's wake was not queued (a duplicate item, or a full queue).
    pub not_queued: Option<NotQueued>,
    /// For a stop: the queued items of the session it removed.
    pub removed: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearResponseVerdict {
    pub activity_id: String,
    pub state: crate::linear::LinearResponseState,
    /// The same key was requested before: this is its earlier activity id and state.
    pub repeated: bool,
}

/// Why a request was refused, in the terms the API reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalKind {
    /// The request is malformed or names something unknown. Fix the input.
    InvalidArgument,
    /// Refused at its place in the log, may succeed if redone (stale plan, claim lost).
    Aborted,
    /// Refused because state does not allow it (fail closed, fold halted, not running).
    FailedPrecondition,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub kind: RefusalKind,
    pub message: String,
}

impl Refusal {
    pub fn new(kind: RefusalKind, message: impl Into<String>) -> Self {
        Refusal { kind, message: message.into() }
    }
}

/// A refusal verdict.
pub(crate) fn refused(kind: RefusalKind, message: impl Into<String>) -> Verdict {
    Verdict::Refused(Refusal::new(kind, message))
}
