//! Surfaces: where messages live and where posts go. A Slack channel's top level (or a DM's main
//! timeline) and each of its threads are separate surfaces with separate journals.
//!
//! The canonical key (`slack:{team}:{channel}` or `slack:{team}:{channel}:thread:{thread_ts}`) is
//! what the API shows and what plans carry. Ids are validated before they get here, so the `:`
//! separator is unambiguous.

use serde::{Deserialize, Serialize};

use crate::proto;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SurfaceId {
    Slack { team: String, channel: String, thread_ts: Option<String> },
}

impl SurfaceId {
    /// The surface of a Slack message: its thread when `thread_ts` is present, non-blank and
    /// differs from its own `ts` (a thread parent lives on the top level), else the top level.
    pub fn slack_message(team: &str, channel: &str, ts: &str, thread_ts: &str) -> Self {
        let thread = thread_ts.trim();
        let thread_ts = (!thread.is_empty() && thread != ts).then(|| thread.to_owned());
        SurfaceId::Slack { team: team.to_owned(), channel: channel.to_owned(), thread_ts }
    }

    /// The outbound surface of a post: the thread when a thread ts is given, else the top level
    /// (a channel's, or a DM's main timeline).
    pub fn from_target(target: &proto::ReplyTarget) -> Option<Self> {
        match target.target.as_ref()? {
            proto::reply_target::Target::Slack(slack) => {
                let thread = slack.thread_ts.trim();
                Some(SurfaceId::Slack {
                    team: slack.team_id.clone(),
                    channel: slack.channel_id.clone(),
                    thread_ts: (!thread.is_empty()).then(|| thread.to_owned()),
                })
            }
        }
    }

    /// The reply target that posts to this surface.
    pub fn to_target(&self) -> proto::ReplyTarget {
        match self {
            SurfaceId::Slack { team, channel, thread_ts } => proto::ReplyTarget {
                target: Some(proto::reply_target::Target::Slack(proto::SlackTarget {
                    team_id: team.clone(),
                    channel_id: channel.clone(),
                    thread_ts: thread_ts.clone().unwrap_or_default(),
                })),
            },
        }
    }

    /// Slack DM channel ids start with `D`.
    pub fn is_dm(&self) -> bool {
        match self {
            SurfaceId::Slack { channel, .. } => channel.starts_with('D'),
        }
    }

    pub fn thread_ts(&self) -> Option<&str> {
        match self {
            SurfaceId::Slack { thread_ts, .. } => thread_ts.as_deref(),
        }
    }

    /// Parses a canonical key; `None` when it is not one.
    pub fn parse(key: &str) -> Option<Self> {
        let mut parts = key.split(':');
        if parts.next()? != "slack" {
            return None;
        }
        let team = parts.next().filter(|s| !s.is_empty())?.to_owned();
        let channel = parts.next().filter(|s| !s.is_empty())?.to_owned();
        let thread_ts = match (parts.next(), parts.next()) {
            (None, _) => None,
            (Some("thread"), Some(ts)) if !ts.is_empty() => Some(ts.to_owned()),
            _ => return None,
        };
        if parts.next().is_some() {
            return None;
        }
        Some(SurfaceId::Slack { team, channel, thread_ts })
    }
}

impl std::fmt::Display for SurfaceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SurfaceId::Slack { team, channel, thread_ts: None } => write!(f, "slack:{team}:{channel}"),
            SurfaceId::Slack { team, channel, thread_ts: Some(ts) } => {
                write!(f, "slack:{team}:{channel}:thread:{ts}")
            }
        }
    }
}

/// The identity of a Slack message, the same for every delivery of it:
/// `slack:{team}:{channel}:{ts}`.
pub fn slack_message_identity(team: &str, channel: &str, ts: &str) -> String {
    format!("slack:{team}:{channel}:{ts}")
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
}
