//! Subscriptions and routing: what wakes an agent, what it follows and has
//! muted, and the attention counters behind mute suggestions. All derived by the fold from the
//! observation itself, in the same step that journals it.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::cold::{Cold, MemoryPage};
use crate::intern::{AgentKey, SurfaceKey};
use crate::journal::RowMeta;
use crate::proto;
use crate::state::{AgentSurface, LogPosition, State, SUBSCRIPTIONS_TAG};
use crate::surface::SurfaceId;
// The note types are plain values the text writer shows: they live with it.
pub use crate::text::{AttentionNote, NoteKind};
use crate::verdict::refused;
use crate::verdict::{RefusalKind, Verdict};
use crate::wake::WakeReason;

const MINUTE_NS: i64 = 60 * 1_000_000_000;
const HOUR_NS: i64 = 60 * MINUTE_NS;
/// Burst: this many follow wakes within [`BURST_WINDOW_NS`] with no post in it.
pub const BURST_WAKES_MIN: usize = 6;
pub const BURST_WINDOW_NS: i64 = HOUR_NS;
/// Chronic: this many follow wakes since the last post, spanning at least [`CHRONIC_SPAN_NS`].
pub const CHRONIC_WAKES_MIN: u32 = 12;
pub const CHRONIC_SPAN_NS: i64 = 72 * HOUR_NS;
/// After a note, no other note on that subscription for this long.
pub const NOTE_BACKOFF_NS: i64 = 24 * HOUR_NS;
/// Follow wakes remembered per subscription for the burst window.
const RECENT_WAKES_MAX: usize = 16;

/// What the fold decided for one message and one receiving agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Route {
    Wake(WakeReason),
    Ignored(IgnoreReason),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum IgnoreReason {
    /// Nothing addresses the agent: a thread it does not follow, a bot's top-level post, a row
    /// without a person's text.
    NotAddressed,
    /// The channel or thread is muted.
    Muted,
    /// The agent wrote it.
    Own,
}

impl IgnoreReason {
    pub fn as_str(self) -> &'static str {
        match self {
            IgnoreReason::NotAddressed => "not_addressed",
            IgnoreReason::Muted => "muted",
            IgnoreReason::Own => "own",
        }
    }
}

/// One channel (member channels) or thread (follows) of one agent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Subscription {
    /// Channels: the agent's app received a delivery there (the channel follow is implicit).
    pub member: bool,
    /// Threads: the agent follows it.
    pub following: bool,
    pub muted: bool,
    pub attention: Attention,
}

/// Counters behind mute suggestions, by log time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attention {
    /// Log times of the latest follow wakes since the last post, oldest first.
    pub recent_wakes_ns: VecDeque<i64>,
    pub wakes_since_post: u32,
    pub first_wake_since_post_ns: Option<i64>,
    pub last_post_ns: Option<i64>,
    /// No note before this log time.
    pub note_backoff_until_ns: i64,
}

impl Attention {
    /// Counts a follow wake at `at_ns`; returns the note it earns, if any.
    fn count_wake(&mut self, at_ns: i64) -> Option<NoteKind> {
        self.wakes_since_post += 1;
        self.first_wake_since_post_ns.get_or_insert(at_ns);
        self.recent_wakes_ns.push_back(at_ns);
        while self.recent_wakes_ns.len() > RECENT_WAKES_MAX {
            self.recent_wakes_ns.pop_front();
        }
        if at_ns < self.note_backoff_until_ns {
            return None;
        }
        let in_window = self.recent_wakes_ns.iter().filter(|t| at_ns - **t < BURST_WINDOW_NS).count();
        let kind = if in_window >= BURST_WAKES_MIN {
            Some(NoteKind::Burst)
        } else if self.wakes_since_post >= CHRONIC_WAKES_MIN
            && self.first_wake_since_post_ns.is_some_and(|first| at_ns - first >= CHRONIC_SPAN_NS)
        {
            Some(NoteKind::Chronic)
        } else {
            None
        };
        if kind.is_some() {
            self.note_backoff_until_ns = at_ns.saturating_add(NOTE_BACKOFF_NS);
        }
        kind
    }

    /// The agent posted: counters start over.
    fn reset_on_post(&mut self, at_ns: i64) {
        self.recent_wakes_ns.clear();
        self.wakes_since_post = 0;
        self.first_wake_since_post_ns = None;
        self.last_post_ns = Some(at_ns);
    }
}

/// Whether `text` mentions `<@bot_user_id>` outside code spans and code blocks.
pub fn mentions(text: &str, bot_user_id: &str) -> bool {
    if bot_user_id.is_empty() {
        return false;
    }
    if !text.contains('`') {
        // No code at all: everything is outside code (the common case, without allocating).
        return mentions_in_plain(text, bot_user_id);
    }
    let mut rest = text;
    let mut outside = String::new();
    // Drop ``` blocks, then `spans`; what remains is outside code.
    while let Some(start) = rest.find("```") {
        outside.push_str(&rest[..start]);
        match rest[start + 3..].find("```") {
            Some(end) => rest = &rest[start + 3 + end + 3..],
            None => {
                rest = "";
            }
        }
    }
    outside.push_str(rest);
    let mut plain = String::new();
    for (index, part) in outside.split('`').enumerate() {
        if index % 2 == 0 {
            plain.push_str(part);
            plain.push(' ');
        }
    }
    mentions_in_plain(&plain, bot_user_id)
}

/// Whether `plain` contains `<@bot_user_id>` or `<@bot_user_id|`.
fn mentions_in_plain(plain: &str, bot_user_id: &str) -> bool {
    plain.match_indices("<@").any(|(index, _)| {
        plain[index + 2..].strip_prefix(bot_user_id).is_some_and(|after| after.starts_with(['>', '|']))
    })
}

/// The channel (or chat) top level of a surface (itself when it is one).
pub fn channel_of(surface: &SurfaceId) -> SurfaceId {
    surface.top_level()
}

/// The thread rooted at the message `ts` (a chat message id) in the channel or chat of `surface`.
pub fn thread_at(surface: &SurfaceId, ts: &str) -> SurfaceId {
    surface.thread_at(ts)
}

/// The facts of one observed message that routing needs.
pub struct Observed<'a> {
    pub surface: &'a SurfaceId,
    pub row: &'a RowMeta,
    /// A Slack DM or a p2p chat.
    pub direct: bool,
    /// It addresses the agent: a Slack `app_mention` or `<@bot_user_id>` outside code, or a chat
    /// message listing the agent's chat user id among its mentions.
    pub mentioned: bool,
    pub is_bot: bool,
    pub text: &'a str,
}

/// A routing decision: the route, where a wake would answer, and a mute note it carries.
pub struct Routed {
    pub route: Route,
    pub reply_to: Option<SurfaceId>,
    pub note: Option<AttentionNote>,
}

impl State {
    /// The subscription of `agent` on `surface`, from memory or read from the store without
    /// keeping it (for tools and list calls that hold the state shared).
    pub fn subscription(&self, agent: &str, surface: &SurfaceId) -> Option<Subscription> {
        let key = (self.agent_keys.key(agent)?, self.surface_key(surface)?);
        self.subscriptions.read_through(SUBSCRIPTIONS_TAG, &key, &self.cold)
    }

    /// The subscription the fold reads, brought into memory first if it left.
    fn subscription_by_key(&mut self, agent: AgentKey, surface: &SurfaceId) -> Option<&Subscription> {
        let key = (agent, self.surface_key(surface)?);
        self.subscriptions.ensure(SUBSCRIPTIONS_TAG, &key, &self.cold);
        self.subscriptions.get(&key)
    }

    fn subscription_mut(&mut self, agent: AgentKey, surface: &SurfaceId) -> &mut Subscription {
        let surface = self.intern_surface(surface);
        self.subscriptions.entry_or_default(SUBSCRIPTIONS_TAG, &(agent, surface), &self.cold)
    }

    /// Every subscription of `agent`, in surface order, from memory and the store.
    pub fn subscriptions_of(&self, agent: &str) -> Vec<(SurfaceId, Subscription)> {
        let Some(agent) = self.agent_keys.key(agent) else { return Vec::new() };
        let prefix = crate::state::tagged(SUBSCRIPTIONS_TAG, &agent);
        let mut entries: Vec<_> = self
            .subscriptions
            .range_entries(&prefix, (agent, SurfaceKey(0))..=(agent, SurfaceKey(u32::MAX)), &self.cold)
            .into_iter()
            .map(|((_, surface), subscription)| (self.surface_of(surface).expect("an interned surface"), subscription))
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        entries
    }

    /// A page of `agent`'s subscriptions, from memory and the store: at most `limit`, after
    /// the page token `after` (the token of a page before; `None` for the first page), in
    /// the order of their checkpoint keys, which is fixed for a key but follows no meaning.
    /// Returns the page and the token of its last entry when the page is full (there may be
    /// more), else `None`. `Err` when `after` is not a token of this agent's subscriptions.
    /// The store is read for the page only: an agent follows every thread it is mentioned in,
    /// so its subscriptions grow with the history. The three steps of
    /// [`State::subscriptions_page_begin`] in one go, for a reader that holds the state
    /// throughout.
    pub fn subscriptions_page(
        &self,
        agent: &str,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<SubscriptionsPage, NotAPageToken> {
        let mut read = self.subscriptions_page_begin(agent, after, limit)?;
        read.read_store();
        Ok(self.subscriptions_page_end(read).expect("no checkpoint is taken while the state is held"))
    }

    /// The first step of a page of [`State::subscriptions_page`], under the state's lock: what
    /// memory holds of it. Then [`SubscriptionsPageRead::read_store`], without the lock (a
    /// page of a large history reads a thousand entries and their surface names from the
    /// store, milliseconds the fold would otherwise wait), then
    /// [`State::subscriptions_page_end`] under the lock again.
    pub fn subscriptions_page_begin(
        &self,
        agent: &str,
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<SubscriptionsPageRead, NotAPageToken> {
        let memory = match self.agent_keys.key(agent) {
            None => None,
            Some(agent_key) => {
                let prefix = crate::state::tagged(SUBSCRIPTIONS_TAG, &agent_key);
                if after.is_some_and(|after| !after.starts_with(&prefix) || after.len() > prefix.len() + 5) {
                    return Err(NotAPageToken);
                }
                Some(self.subscriptions.memory_page(SUBSCRIPTIONS_TAG, &prefix, after, limit, |(a, _)| *a == agent_key))
            }
        };
        Ok(SubscriptionsPageRead { memory, cold: self.cold.clone(), limit, read: Vec::new() })
    }

    /// The last step of a page of [`State::subscriptions_page`], under the state's lock: the
    /// page as the state was at [`State::subscriptions_page_begin`], or `None` when a
    /// checkpoint was taken since (what was read from the store may be newer: begin again).
    pub fn subscriptions_page_end(&self, read: SubscriptionsPageRead) -> Option<SubscriptionsPage> {
        if read.cold.taken() != self.cold.taken() {
            return None;
        }
        let next =
            (read.read.len() == read.limit).then(|| read.read.last().map(|(stored, ..)| stored.clone())).flatten();
        let page = read
            .read
            .into_iter()
            .map(|(_, surface, subscription, name)| {
                // A name the store did not hold yet is one interned since the last checkpoint.
                let name = name.or_else(|| self.surface_of(surface)).expect("an interned surface");
                (name, subscription)
            })
            .collect();
        Some((page, next))
    }

    /// Routes one observed message for one receiving agent (first match wins), updating follows
    /// and membership in the same step. Attention is counted only when the wake is queued.
    pub(crate) fn route(&mut self, agent: &str, observed: &Observed<'_>) -> Routed {
        let ignored = |reason| Routed { route: Route::Ignored(reason), reply_to: None, note: None };
        let surface = observed.surface;
        let row = observed.row;
        let dm = observed.direct;
        let channel = channel_of(surface);
        let agent_key = self.agent_keys.intern(agent);
        if !dm {
            let membership = self.subscription_by_key(agent_key, &channel).is_some_and(|s| s.member);
            if !membership {
                self.subscription_mut(agent_key, &channel).member = true;
            }
        }
        if row.is_own(agent) {
            return ignored(IgnoreReason::Own);
        }
        let routable = !row.user_id.is_empty() && !observed.text.trim().is_empty();
        if !routable {
            return ignored(IgnoreReason::NotAddressed);
        }
        if dm {
            return Routed { route: Route::Wake(WakeReason::Dm), reply_to: Some(surface.clone()), note: None };
        }
        if observed.mentioned {
            let thread = match surface.thread_ts() {
                Some(_) => surface.clone(),
                None => thread_at(surface, &row.ts),
            };
            if !observed.is_bot {
                let subscription = self.subscription_mut(agent_key, &thread);
                subscription.following = true;
                subscription.muted = false;
            }
            return Routed { route: Route::Wake(WakeReason::Mention), reply_to: Some(thread), note: None };
        }
        if surface.thread_ts().is_some() {
            return match self.subscription_by_key(agent_key, surface) {
                Some(s) if s.following && s.muted => ignored(IgnoreReason::Muted),
                Some(s) if s.following => {
                    Routed { route: Route::Wake(WakeReason::ThreadFollow), reply_to: Some(surface.clone()), note: None }
                }
                _ => ignored(IgnoreReason::NotAddressed),
            };
        }
        if observed.is_bot {
            return ignored(IgnoreReason::NotAddressed);
        }
        if self.subscription_by_key(agent_key, &channel).is_some_and(|s| s.muted) {
            return ignored(IgnoreReason::Muted);
        }
        Routed {
            route: Route::Wake(WakeReason::ChannelFollow),
            reply_to: Some(thread_at(surface, &row.ts)),
            note: None,
        }
    }

    /// Counts a queued follow wake on its subscription; returns the note it carries, if any.
    pub(crate) fn count_follow_wake(
        &mut self,
        at: LogPosition,
        agent: &str,
        reason: WakeReason,
        surface: &SurfaceId,
    ) -> Option<AttentionNote> {
        let target = match reason {
            WakeReason::ChannelFollow => channel_of(surface),
            WakeReason::ThreadFollow => surface.clone(),
            WakeReason::Dm | WakeReason::Mention | WakeReason::Linear | WakeReason::Memory => return None,
        };
        let agent = self.agent_keys.intern(agent);
        let attention = &mut self.subscription_mut(agent, &target).attention;
        let kind = attention.count_wake(at.at_ns)?;
        let wakes = attention.wakes_since_post;
        Some(AttentionNote { kind, target, wakes })
    }

    /// The agent posted on `surface` (a message or an ask, not a file): a threaded post follows
    /// its thread, un-mutes it and resets its counters; a top-level channel post follows the
    /// thread it may start and resets the channel's counters.
    pub(crate) fn note_own_post(&mut self, at: LogPosition, agent: &str, surface: &SurfaceId, ts: &str) {
        if self.is_direct(surface) {
            return;
        }
        let agent = self.agent_keys.intern(agent);
        match surface.thread_ts() {
            Some(_) => {
                let subscription = self.subscription_mut(agent, surface);
                subscription.following = true;
                subscription.muted = false;
                subscription.attention.reset_on_post(at.at_ns);
            }
            None => {
                self.subscription_mut(agent, &thread_at(surface, ts)).following = true;
                self.subscription_mut(agent, surface).attention.reset_on_post(at.at_ns);
            }
        }
    }

    pub(crate) fn change_subscription(
        &mut self,
        _at: LogPosition,
        request: &proto::SubscriptionChangeRequested,
    ) -> Verdict {
        if !self.agents.contains_key(&request.agent_id) {
            return refused(RefusalKind::InvalidArgument, format!("agent {:?} is not registered", request.agent_id));
        }
        let surface = match (request.target.as_ref(), request.chat_target.as_ref()) {
            (Some(slack), None) => SurfaceId::from_target(&proto::ReplyTarget {
                target: Some(proto::reply_target::Target::Slack(slack.clone())),
            })
            .expect("a Slack target is a surface"),
            (None, Some(chat)) => SurfaceId::from_chat_target(chat),
            (None, None) => return refused(RefusalKind::InvalidArgument, "target is missing"),
            (Some(_), Some(_)) => {
                return refused(RefusalKind::InvalidArgument, "both a Slack and a chat target are set; set one")
            }
        };
        if surface.is_slack_dm() {
            return refused(RefusalKind::InvalidArgument, format!("target: {surface} is a DM; DMs cannot be muted"));
        }
        if self.is_direct(&surface) {
            return refused(
                RefusalKind::InvalidArgument,
                format!("chat_target: {surface} is a p2p chat; p2p chats cannot be muted"),
            );
        }
        let current = match self.agent_keys.key(&request.agent_id) {
            Some(agent) => self.subscription_by_key(agent, &surface).is_some_and(|s| s.muted),
            None => false,
        };
        if !request.mute && !current {
            return refused(RefusalKind::FailedPrecondition, format!("{surface} is not muted; nothing to unmute"));
        }
        let agent = self.agent_keys.intern(&request.agent_id);
        self.subscription_mut(agent, &surface).muted = request.mute;
        Verdict::SubscriptionChanged { surface, muted: request.mute }
    }
}

/// A page of an agent's subscriptions between [`State::subscriptions_page_begin`] and
/// [`State::subscriptions_page_end`].
pub struct SubscriptionsPageRead {
    /// What memory held (`None`: an agent the fold never wrote for, whose page is empty).
    memory: Option<MemoryPage<AgentSurface, Subscription>>,
    /// The store, and the checkpoints taken when the page began.
    cold: Cold,
    limit: usize,
    /// The page once read: checkpoint key, surface, subscription, and the surface's name if
    /// the store held it.
    read: Vec<(Vec<u8>, SurfaceKey, Subscription, Option<SurfaceId>)>,
}

impl SubscriptionsPageRead {
    /// Reads the store's part of the page and the names of its surfaces, without the state.
    /// A surface's name never changes once interned, so a name the store holds is the one the
    /// state has.
    pub fn read_store(&mut self) {
        let Some(memory) = self.memory.take() else { return };
        self.read = memory
            .read_store(&self.cold)
            .into_iter()
            .map(|(stored, (_, surface), subscription)| {
                let name = crate::intern::stored_surface(surface, &self.cold);
                (stored, surface, subscription, name)
            })
            .collect();
    }
}

/// A page of an agent's subscriptions, and the token of the next page when there may be one.
pub type SubscriptionsPage = (Vec<(SurfaceId, Subscription)>, Option<Vec<u8>>);

/// A page token that is not one of the subscriptions asked for (another agent's, or not a
/// token at all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotAPageToken;

#[cfg(test)]
mod tests {
    use super::*;

    /// The first form of [`mentions`]: strip code, then search the two needles.
    fn mentions_reference(text: &str, bot_user_id: &str) -> bool {
        if bot_user_id.is_empty() {
            return false;
        }
        let needle = format!("<@{bot_user_id}>");
        let needle_with_label = format!("<@{bot_user_id}|");
        let mut rest = text;
        let mut outside = String::new();
        while let Some(start) = rest.find("```") {
            outside.push_str(&rest[..start]);
            match rest[start + 3..].find("```") {
                Some(end) => rest = &rest[start + 3 + end + 3..],
                None => rest = "",
            }
        }
        outside.push_str(rest);
        let mut plain = String::new();
        for (index, part) in outside.split('`').enumerate() {
            if index % 2 == 0 {
                plain.push_str(part);
                plain.push(' ');
            }
        }
        plain.contains(&needle) || plain.contains(&needle_with_label)
    }

    #[test]
    fn mentions_outside_code_only() {
        assert!(mentions("hi <@U1>", "U1"));
        assert!(mentions("hi <@U1|ada> there", "U1"));
        assert!(!mentions("hi <@U12>", "U1"));
        assert!(!mentions("`<@U1>`", "U1"));
        assert!(!mentions("```\n<@U1>\n```", "U1"));
        assert!(mentions("<```x```@U1>", "U1"), "a removed block joins what surrounds it");
        assert!(!mentions("<@U1>", ""));
    }

    proptest::proptest! {
        #[test]
        fn mentions_agrees_with_its_first_form(text in "[<@>|`U1 a]{0,24}", id in "U1?") {
            proptest::prop_assert_eq!(mentions(&text, &id), mentions_reference(&text, &id));
        }
    }
}
