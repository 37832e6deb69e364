//! Failure notice owed: when a wake a person asked for is given up, the person is told. A wake
//! that came from a DM or a direct mention (never a follow: nobody asked) and finished `failed`
//! records a notice owed to its `reply_to`, with the reason class; the runtime sees the agent's
//! owed notices on Watch and Claim and posts one short line there; the notice is settled by the
//! agent's next confirmed post on that surface. Analytics counts notices owed and settled.

use serde::{Deserialize, Serialize};

use crate::state::{LogPosition, State};
use crate::surface::SurfaceId;
use crate::wake::{WakeItem, WakeReason};

/// Notices owed kept per agent; beyond it the oldest is let go (counted as owed, never shown
/// again): an agent failing this many requests in a row needs an operator, not more notices.
pub const NOTICES_OWED_PER_AGENT_MAX: usize = 64;

/// Why a notice is owed, as a class the runtime words (never the runtime's own failure prose,
/// which may carry content).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum NoticeReason {
    /// The wake finished `failed`.
    WakeFailed,
}

impl NoticeReason {
    pub fn as_str(self) -> &'static str {
        match self {
            NoticeReason::WakeFailed => "wake_failed",
        }
    }
}

/// A notice owed to the person whose request a given-up wake was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwedNotice {
    /// The wake item that was given up.
    pub item_id: String,
    pub wake_reason: WakeReason,
    pub reason: NoticeReason,
    /// Where the notice goes: the wake's reply target.
    pub reply_to: SurfaceId,
    /// Log seq of the finish that made it owed.
    pub owed_seq: u64,
}

impl State {
    /// Records a notice owed for `item`, given up at `at`, when a person asked for it (a DM or a
    /// direct mention) and it has a conversation to answer in. Returns whether one was recorded.
    pub(crate) fn owe_failure_notice(&mut self, at: LogPosition, agent: &str, item: &WakeItem) -> bool {
        let asked = matches!(item.reason, WakeReason::Dm | WakeReason::Mention);
        let conversation = matches!(item.reply_to, SurfaceId::Slack { .. } | SurfaceId::Chat { .. });
        if !asked || !conversation || item.memory.is_some() {
            return false;
        }
        let notice = OwedNotice {
            item_id: item.id.clone(),
            wake_reason: item.reason,
            reason: NoticeReason::WakeFailed,
            reply_to: item.reply_to.clone(),
            owed_seq: at.seq,
        };
        self.notices_owed.insert((agent.to_owned(), at.seq), notice);
        while self.notices_owed_of(agent).count() > NOTICES_OWED_PER_AGENT_MAX {
            let oldest = self.notices_owed_of(agent).next().map(|n| n.owed_seq).expect("more than the bound");
            self.notices_owed.remove(&(agent.to_owned(), oldest));
        }
        true
    }

    /// The agent posted on `surface` (a confirmed post): every notice owed there is settled.
    /// Returns the item ids of the notices it settled, oldest first.
    pub(crate) fn settle_failure_notices(&mut self, agent: &str, surface: &SurfaceId) -> Vec<String> {
        let settled: Vec<(u64, String)> = self
            .notices_owed_of(agent)
            .filter(|n| &n.reply_to == surface)
            .map(|n| (n.owed_seq, n.item_id.clone()))
            .collect();
        for (seq, _) in &settled {
            self.notices_owed.remove(&(agent.to_owned(), *seq));
        }
        settled.into_iter().map(|(_, item)| item).collect()
    }

    /// The agent's owed notices, oldest first.
    pub fn notices_owed_of<'a>(&'a self, agent: &str) -> impl Iterator<Item = &'a OwedNotice> + 'a {
        let from = (agent.to_owned(), 0);
        let to = (agent.to_owned(), u64::MAX);
        self.notices_owed.range(from..=to).map(|(_, notice)| notice)
    }
}
