//! Surfaces: where messages live and where posts go. A Slack channel's top level (or a DM's main
//! timeline) and each of its threads are separate surfaces with separate journals; so are a
//! chat's top level and each of its threads (the generic chat platform).
//!
//! The canonical key is what the API shows and what plans carry:
//! `slack:{team}:{channel}`, `slack:{team}:{channel}:thread:{thread_ts}`, `chat:{tenant}:{chat}`
//! and `chat:{tenant}:{chat}:thread:{thread}`. Slack ids are validated to letters and digits
//! before they get here, so the `:` separator is unambiguous for them. Chat ids come from any
//! platform and may contain `:` (Matrix room ids do), so in chat keys `%` and `:` are written as
//! `%25` and `%3A`: [`SurfaceId::parse`] inverts [`std::fmt::Display`] exactly.

use serde::{Deserialize, Serialize};

use crate::proto;

/// An id inside a surface (team, channel, thread ts, chat id...): a string kept inline up to 24
/// bytes, which Slack's ids all are, so the many copies of a surface the fold makes per event
/// allocate nothing. Encoded, ordered and hashed exactly as a `String`.
pub type Id = compact_str::CompactString;

/// The variant order is part of the persisted order of every table keyed by surface: new
/// variants go last.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SurfaceId {
    Slack {
        team: Id,
        channel: Id,
        thread_ts: Option<Id>,
    },
    Chat {
        tenant: Id,
        chat: Id,
        thread: Option<Id>,
    },
    /// A Linear agent session (a UUID, validated at ingest): the surface and the reply target of
    /// Linear wakes. It has no journal and no cursors; answers go through the response protocol.
    Linear {
        session: Id,
    },
    /// An agent's memory (`MEMORY.md` and `notes/`): the surface of its memory passes. It has no
    /// journal, no cursors and no reply target.
    Memory {
        agent: Id,
    },
}

/// Whether a chat is one-to-one (behaves like a DM) or a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ChatKind {
    P2p,
    Group,
}

impl ChatKind {
    /// `None` for an unspecified or unknown kind.
    pub fn from_proto(kind: i32) -> Option<Self> {
        match proto::ChatKind::try_from(kind) {
            Ok(proto::ChatKind::P2p) => Some(ChatKind::P2p),
            Ok(proto::ChatKind::Group) => Some(ChatKind::Group),
            Ok(proto::ChatKind::Unspecified) | Err(_) => None,
        }
    }
}

impl SurfaceId {
    /// The surface of a Slack message: its thread when `thread_ts` is present, non-blank and
    /// differs from its own `ts` (a thread parent lives on the top level), else the top level.
    pub fn slack_message(team: &str, channel: &str, ts: &str, thread_ts: &str) -> Self {
        let thread = thread_ts.trim();
        let thread_ts = (!thread.is_empty() && thread != ts).then(|| Id::from(thread));
        SurfaceId::Slack { team: team.into(), channel: channel.into(), thread_ts }
    }

    /// The surface of a chat message: its thread when `thread_id` is present, non-blank and
    /// differs from its own message id (a thread root lives on the top level), else the top level.
    pub fn chat_message(tenant: &str, chat: &str, message_id: &str, thread_id: &str) -> Self {
        let thread = thread_id.trim();
        let thread = (!thread.is_empty() && thread != message_id).then(|| Id::from(thread));
        SurfaceId::Chat { tenant: tenant.into(), chat: chat.into(), thread }
    }

    /// The outbound surface of a post: the thread when a thread ts (id) is given, else the top
    /// level (a channel's, a chat's, or a DM's main timeline).
    pub fn from_target(target: &proto::ReplyTarget) -> Option<Self> {
        match target.target.as_ref()? {
            proto::reply_target::Target::Slack(slack) => {
                let thread = slack.thread_ts.trim();
                Some(SurfaceId::Slack {
                    team: slack.team_id.as_str().into(),
                    channel: slack.channel_id.as_str().into(),
                    thread_ts: (!thread.is_empty()).then(|| Id::from(thread)),
                })
            }
            proto::reply_target::Target::Chat(chat) => Some(SurfaceId::from_chat_target(chat)),
            proto::reply_target::Target::Linear(linear) => {
                Some(SurfaceId::Linear { session: linear.session_id.as_str().into() })
            }
        }
    }

    pub fn from_chat_target(target: &proto::ChatTarget) -> Self {
        let thread = target.thread_id.trim();
        SurfaceId::Chat {
            tenant: target.tenant_id.as_str().into(),
            chat: target.chat_id.as_str().into(),
            thread: (!thread.is_empty()).then(|| Id::from(thread)),
        }
    }

    /// The reply target that posts to this surface.
    pub fn to_target(&self) -> proto::ReplyTarget {
        let target = match self {
            SurfaceId::Slack { team, channel, thread_ts } => proto::reply_target::Target::Slack(proto::SlackTarget {
                team_id: team.to_string(),
                channel_id: channel.to_string(),
                thread_ts: thread_ts.as_deref().unwrap_or_default().to_owned(),
            }),
            SurfaceId::Chat { tenant, chat, thread } => proto::reply_target::Target::Chat(proto::ChatTarget {
                tenant_id: tenant.to_string(),
                chat_id: chat.to_string(),
                thread_id: thread.as_deref().unwrap_or_default().to_owned(),
            }),
            SurfaceId::Linear { session } => {
                proto::reply_target::Target::Linear(proto::LinearTarget { session_id: session.to_string() })
            }
            // A memory pass answers nobody.
            SurfaceId::Memory { .. } => return proto::ReplyTarget { target: None },
        };
        proto::ReplyTarget { target: Some(target) }
    }

    /// Slack DM channel ids start with `D`. Whether a chat is one-to-one is not in its id: the
    /// fold remembers it from observations (`State::is_direct`).
    pub fn is_slack_dm(&self) -> bool {
        match self {
            SurfaceId::Slack { channel, .. } => channel.starts_with('D'),
            SurfaceId::Chat { .. } | SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => false,
        }
    }

    /// The thread ts (Slack) or thread id (chat), when this is a thread.
    pub fn thread_ts(&self) -> Option<&str> {
        match self {
            SurfaceId::Slack { thread_ts, .. } => thread_ts.as_deref(),
            SurfaceId::Chat { thread, .. } => thread.as_deref(),
            SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => None,
        }
    }

    /// The top level of this surface's channel or chat (itself when it is one).
    pub fn top_level(&self) -> SurfaceId {
        match self {
            SurfaceId::Slack { team, channel, .. } => {
                SurfaceId::Slack { team: team.clone(), channel: channel.clone(), thread_ts: None }
            }
            SurfaceId::Chat { tenant, chat, .. } => {
                SurfaceId::Chat { tenant: tenant.clone(), chat: chat.clone(), thread: None }
            }
            SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => self.clone(),
        }
    }

    /// The thread rooted at the message `ts` (Slack) or message id (chat) in this surface's
    /// channel or chat.
    pub fn thread_at(&self, root: &str) -> SurfaceId {
        match self {
            SurfaceId::Slack { team, channel, .. } => {
                SurfaceId::Slack { team: team.clone(), channel: channel.clone(), thread_ts: Some(root.into()) }
            }
            SurfaceId::Chat { tenant, chat, .. } => {
                SurfaceId::Chat { tenant: tenant.clone(), chat: chat.clone(), thread: Some(root.into()) }
            }
            // A session and a memory have no threads.
            SurfaceId::Linear { .. } | SurfaceId::Memory { .. } => self.clone(),
        }
    }

    /// Whether rows of this surface are ordered by their Slack ts. Chat rows have no platform
    /// time: their order is the log's.
    pub fn orders_by_ts(&self) -> bool {
        matches!(self, SurfaceId::Slack { .. })
    }

    /// Parses a canonical key; `None` when it is not one.
    pub fn parse(key: &str) -> Option<Self> {
        if let Some(session) = key.strip_prefix("linear:") {
            let valid = !session.is_empty() && session.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
            return valid.then(|| SurfaceId::Linear { session: session.into() });
        }
        if let Some(agent) = key.strip_prefix("memory:") {
            let surface = SurfaceId::Memory { agent: unescape_key_part(agent)?.into() };
            return (!agent.is_empty() && surface.to_string() == key).then_some(surface);
        }
        let mut parts = key.split(':');
        let platform = parts.next()?;
        let first = parts.next().filter(|s| !s.is_empty())?;
        let second = parts.next().filter(|s| !s.is_empty())?;
        let thread = match (parts.next(), parts.next()) {
            (None, _) => None,
            (Some("thread"), Some(thread)) if !thread.is_empty() => Some(thread),
            _ => return None,
        };
        if parts.next().is_some() {
            return None;
        }
        let surface = match platform {
            "slack" => SurfaceId::Slack { team: first.into(), channel: second.into(), thread_ts: thread.map(Id::from) },
            "chat" => SurfaceId::Chat {
                tenant: unescape_key_part(first)?.into(),
                chat: unescape_key_part(second)?.into(),
                thread: match thread {
                    Some(thread) => Some(unescape_key_part(thread)?.into()),
                    None => None,
                },
            },
            _ => return None,
        };
        // Only canonical keys parse: one surface, one key.
        (surface.to_string() == key).then_some(surface)
    }
}

impl std::fmt::Display for SurfaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SurfaceId::Slack { team, channel, thread_ts: None } => write!(f, "slack:{team}:{channel}"),
            SurfaceId::Slack { team, channel, thread_ts: Some(ts) } => {
                write!(f, "slack:{team}:{channel}:thread:{ts}")
            }
            SurfaceId::Chat { tenant, chat, thread } => {
                write!(f, "chat:{}:{}", escape_key_part(tenant), escape_key_part(chat))?;
                if let Some(thread) = thread {
                    write!(f, ":thread:{}", escape_key_part(thread))?;
                }
                Ok(())
            }
            SurfaceId::Linear { session } => write!(f, "linear:{session}"),
            SurfaceId::Memory { agent } => write!(f, "memory:{}", escape_key_part(agent)),
        }
    }
}

/// Writes `%` as `%25` and `:` as `%3A`, so a chat id cannot split a key.
fn escape_key_part(raw: &str) -> std::borrow::Cow<'_, str> {
    if !raw.contains(['%', ':']) {
        return std::borrow::Cow::Borrowed(raw);
    }
    std::borrow::Cow::Owned(raw.replace('%', "%25").replace(':', "%3A"))
}

/// Inverse of [`escape_key_part`]; `None` for any other `%` sequence.
fn unescape_key_part(part: &str) -> Option<String> {
    let mut out = String::with_capacity(part.len());
    let mut rest = part;
    while let Some(index) = rest.find('%') {
        out.push_str(&rest[..index]);
        let escape = rest.get(index..index + 3)?;
        match escape {
            "%25" => out.push('%'),
            "%3A" => out.push(':'),
            _ => return None,
        }
        rest = &rest[index + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// The identity of a Slack message, the same for every delivery of it:
/// `slack:{team}:{channel}:{ts}`.
pub fn slack_message_identity(team: &str, channel: &str, ts: &str) -> String {
    // Built by hand: made for every Slack message the fold journals, where `format!` cost
    // several times the copy.
    let mut identity = String::with_capacity("slack:::".len() + team.len() + channel.len() + ts.len());
    for part in ["slack:", team, ":", channel, ":", ts] {
        identity.push_str(part);
    }
    identity
}

/// A Linear receipt's kind, as it appears in the receipt identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum LinearReceiptKind {
    Created,
    Prompted,
}

impl LinearReceiptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            LinearReceiptKind::Created => "created",
            LinearReceiptKind::Prompted => "prompted",
        }
    }
}

/// The receipt identity of a Linear session event:
/// `linear:{installation}:{created|prompted}:{session id | agent activity id}`. The first receipt
/// wins; it is also the wake item id.
pub fn linear_receipt_identity(installation: &str, kind: LinearReceiptKind, id: &str) -> String {
    format!("linear:{}:{}:{}", escape_key_part(installation), kind.as_str(), escape_key_part(id))
}

/// The identity of a chat message, the same for every delivery of it:
/// `chat:{tenant}:{chat}:{message_id}`, each id escaped as in surface keys.
pub fn chat_message_identity(tenant: &str, chat: &str, message_id: &str) -> String {
    format!("chat:{}:{}:{}", escape_key_part(tenant), escape_key_part(chat), escape_key_part(message_id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_only_when_thread_ts_differs() {
        let top = SurfaceId::slack_message("T1", "C1", "1.000001", "");
        assert_eq!(top.to_string(), "slack:T1:C1");
        let parent = SurfaceId::slack_message("T1", "C1", "1.000001", "1.000001");
        assert_eq!(parent, top);
        let blank = SurfaceId::slack_message("T1", "C1", "1.000001", "  ");
        assert_eq!(blank, top);
        let reply = SurfaceId::slack_message("T1", "C1", "2.000001", "1.000001");
        assert_eq!(reply.to_string(), "slack:T1:C1:thread:1.000001");
        assert_eq!(SurfaceId::parse(&reply.to_string()), Some(reply));
        assert_eq!(SurfaceId::parse(&top.to_string()), Some(top));
        assert_eq!(SurfaceId::parse("slack:T1"), None);
        assert_eq!(SurfaceId::parse("slack:T1:C1:thread:"), None);
        assert_eq!(SurfaceId::parse("linear:x:y"), None);
    }

    #[test]
    fn chat_threads_and_keys() {
        let top = SurfaceId::chat_message("t1", "oc_1", "om_1", "");
        assert_eq!(top.to_string(), "chat:t1:oc_1");
        assert_eq!(SurfaceId::chat_message("t1", "oc_1", "om_1", "om_1"), top, "a thread root is top level");
        let reply = SurfaceId::chat_message("t1", "oc_1", "om_2", "om_1");
        assert_eq!(reply.to_string(), "chat:t1:oc_1:thread:om_1");
        assert_eq!(reply.top_level(), top);
        assert_eq!(top.thread_at("om_1"), reply);
        assert_eq!(SurfaceId::parse("chat:t1:oc_1"), Some(top.clone()));
        assert_eq!(SurfaceId::parse("chat:t1:oc_1:thread:om_1"), Some(reply.clone()));
        assert_eq!(SurfaceId::from_target(&reply.to_target()), Some(reply));
        assert!(top < SurfaceId::parse("chat:t1:oc_2").unwrap());
        assert!(SurfaceId::parse("slack:T9:C9").unwrap() < top, "new variants sort after Slack");
    }

    #[test]
    fn chat_ids_with_separators_round_trip_and_only_canonical_keys_parse() {
        let odd = SurfaceId::Chat {
            tenant: "a:b%c".into(),
            chat: "!room:matrix.org".into(),
            thread: Some("$ev:x%3A".into()),
        };
        let key = odd.to_string();
        assert_eq!(key, "chat:a%3Ab%25c:!room%3Amatrix.org:thread:$ev%3Ax%253A");
        assert_eq!(SurfaceId::parse(&key), Some(odd));
        for bad in [
            "chat:t:c:thread",
            "chat::c",
            "chat:t:%3a",
            "chat:t:%41",
            "chat:t:%",
            "chat:t:c:x:y",
            "chat:t:c:thread:a:b",
        ] {
            assert_eq!(SurfaceId::parse(bad), None, "{bad}");
        }
        assert_eq!(chat_message_identity("t", "a:b", "m%"), "chat:t:a%3Ab:m%25");
    }

    proptest::proptest! {
        /// Any non-empty chat ids: the key parses back to the surface, and distinct surfaces
        /// have distinct keys (the key is the surface's identity in plans and the API).
        #[test]
        fn chat_keys_round_trip(
            tenant in "[a:%3A5_ ]{1,6}",
            chat in "(?s).{1,8}",
            thread in proptest::option::of("[a:%b]{1,6}"),
            other in "[a:%3A]{1,6}",
        ) {
            let surface = SurfaceId::Chat { tenant: tenant.as_str().into(), chat: chat.into(), thread: thread.map(Into::into) };
            proptest::prop_assert_eq!(SurfaceId::parse(&surface.to_string()), Some(surface.clone()));
            let SurfaceId::Chat { chat, thread, .. } = &surface else { unreachable!() };
            let moved = SurfaceId::Chat { tenant: other.as_str().into(), chat: chat.clone(), thread: thread.clone() };
            proptest::prop_assert_eq!(tenant == other, moved.to_string() == surface.to_string());
        }
    }
}
