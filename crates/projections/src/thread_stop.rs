//! Slack thread stop: the user stopped the agent in a thread (Slack's assistant/agent thread
//! stop). The thread's queued input for that agent is removed, as a Linear stop removes a
//! session's; a wake already claimed or running is left to finish (the runtime stops it itself),
//! and nothing else changes — no cursor moves, no other agent is touched.

use serde::{Deserialize, Serialize};

use crate::proto;
use crate::state::State;
use crate::surface::SurfaceId;
use crate::verdict::refused;
use crate::verdict::{RefusalKind, Verdict};
use crate::wake::WakeItem;

/// What a thread stop did for its receiving agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadStopVerdict {
    pub agent: String,
    pub surface: SurfaceId,
    /// The queued items of the thread it removed, oldest first.
    pub removed: Vec<String>,
}

impl State {
    pub(crate) fn stop_slack_thread(&mut self, stop: &proto::SlackThreadStopObserved) -> Verdict {
        self.ensure_queue(&stop.receiving_agent_id);
        let agent = stop.receiving_agent_id.as_str();
        if !self.agents.contains_key(&stop.receiving_agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {agent:?} is not registered"));
        }
        if stop.thread_ts.trim().is_empty() {
            return refused(RefusalKind::InvalidArgument, "thread_ts is empty: a stop names a thread");
        }
        let thread = SurfaceId::Slack {
            team: stop.team_id.as_str().into(),
            channel: stop.channel_id.as_str().into(),
            thread_ts: Some(stop.thread_ts.trim().into()),
        };
        // Input of the thread: wakes triggered in it, and wakes that answer into it (a mention on
        // the thread's parent is triggered on the top level and replies in the thread).
        let of_thread = |item: &WakeItem| item.trigger_surface == thread || item.reply_to == thread;
        let key = stop.receiving_agent_id.clone();
        // Only a queue that holds some of the thread's items is touched (and so checkpointed).
        let touched = self.queues.get(&key).is_some_and(|q| q.queued().any(of_thread));
        let removed = match self.queues.get_mut(&key) {
            Some(queue) if touched => queue.retain(|i| !of_thread(i)),
            _ => Vec::new(),
        };
        Verdict::ThreadStopped(ThreadStopVerdict { agent: key, surface: thread, removed })
    }
}
