//! Per-surface journals: every observable message gets the next dense ordinal on its surface, in
//! log order. The fold keeps the tail, who owns the trailing run of rows, and the metadata of
//! recent rows — not the bodies. Bodies ([`RowBody`]) come from the engine's bounded cache or from
//! the log by sequence when something is rendered.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::proto;

/// Metadata of recent rows kept per surface. Held notices and wake texts show at most
/// [`crate::render::ROWS_SHOWN_MAX`] rows, so a window of this size always holds the rows they
/// can show; older metadata is dropped to bound memory per surface.
pub const RECENT_ROWS_MAX: usize = 64;

/// What the fold keeps of one journal row.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowMeta {
    pub ordinal: u64,
    /// Log sequence of the event that journaled it; its body is read from there.
    pub seq: u64,
    /// Log time of that event, unix ns.
    pub at_ns: i64,
    /// Slack ts and its whole seconds; for chat rows the platform's message id and the whole
    /// seconds of the log time that journaled it (chat messages carry no time of their own).
    pub ts: String,
    pub ts_seconds: i64,
    pub user_id: String,
    pub bot_id: String,
    /// The agent whose platform identity wrote it, classified when it was journaled.
    pub owner: Option<String>,
    /// Rendered size for a reader who does not own it, and of its sender label and body.
    pub row_bytes: u32,
    pub sender_bytes: u32,
    pub body_bytes: u32,
}

impl RowMeta {
    /// Whether `agent` wrote it.
    pub fn is_own(&self, agent: &str) -> bool {
        self.owner.as_deref() == Some(agent)
    }

    /// Rendered size as `reader` sees it (own rows say `you`).
    pub fn bytes_for(&self, reader: &str) -> usize {
        if self.is_own(reader) {
            (self.row_bytes - self.sender_bytes) as usize + crate::render::YOU.len()
        } else {
            self.row_bytes as usize
        }
    }
}

/// The content of a row, as read from its stored event. Never kept in fold state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RowBody {
    pub text: String,
    pub user_name: String,
    pub files: Vec<proto::SlackFile>,
    /// Link previews (Slack unfurls); shown for the trigger of a wake only, as an extra.
    pub previews: Vec<proto::LinkPreview>,
}

impl RowBody {
    /// The body of a journaled event (a Slack or chat observation, or a confirmed own post).
    pub fn from_envelope(envelope: &proto::Envelope) -> Option<RowBody> {
        use proto::envelope::Payload;
        match envelope.payload.as_ref()? {
            Payload::SlackMessage(m) => Some(RowBody {
                text: m.text.clone(),
                user_name: m.user_name.clone(),
                files: m.files.clone(),
                previews: m.previews.clone(),
            }),
            Payload::ChatMessage(m) => Some(RowBody {
                text: m.text.clone(),
                user_name: m.sender_name.clone(),
                files: m.files.clone(),
                previews: Vec::new(),
            }),
            // The prompt is the body of a Linear wake's trigger; the issue title stands where a
            // sender's name would.
            Payload::LinearSession(e) => {
                Some(RowBody { text: e.prompt_text.clone(), user_name: e.issue_title.clone(), ..RowBody::default() })
            }
            Payload::SendConfirmed(c) => {
                Some(RowBody { text: c.text.clone(), files: c.files.clone(), ..RowBody::default() })
            }
            _ => None,
        }
    }

    /// Bytes this body takes in memory, for cache accounting: its heap buffers and the fixed
    /// part of it and of a cache entry, not only the text (with short messages the fixed part
    /// is most of it, and a cache bounded by text bytes alone held several times its bound).
    pub fn size_bytes(&self) -> usize {
        use prost::Message;
        /// A cache entry beyond the body: the `Arc`'s counts and the map's key and node share.
        const CACHE_ENTRY_OVERHEAD_BYTES: usize = 64;
        std::mem::size_of::<RowBody>()
            + CACHE_ENTRY_OVERHEAD_BYTES
            + self.text.capacity()
            + self.user_name.capacity()
            + self.files.iter().map(|f| std::mem::size_of::<proto::SlackFile>() + f.encoded_len()).sum::<usize>()
            + self.previews.iter().map(|p| std::mem::size_of::<proto::LinkPreview>() + p.encoded_len()).sum::<usize>()
    }
}

/// One surface's journal.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SurfaceJournal {
    /// Ordinal of the newest row (0: empty).
    pub tail: u64,
    /// The agent that wrote the trailing run of rows, if one did; with `trailing_run_start` this
    /// answers "the newest row not written by agent A" exactly, whatever the window holds.
    pub trailing_owner: Option<String>,
    pub trailing_run_start: u64,
    /// The newest rows, oldest first, at most [`RECENT_ROWS_MAX`].
    pub recent: VecDeque<RowMeta>,
}

/// The rows a decision needed were no longer in the window: fail closed.
#[derive(Debug, PartialEq, Eq)]
pub struct RowsMissing {
    pub ordinal: u64,
}

impl SurfaceJournal {
    /// Appends the next row; `meta.ordinal` must be `tail + 1`.
    pub fn push(&mut self, meta: RowMeta) {
        debug_assert_eq!(meta.ordinal, self.tail + 1);
        self.tail = meta.ordinal;
        if meta.owner.is_none() || meta.owner != self.trailing_owner {
            self.trailing_owner = meta.owner.clone();
            self.trailing_run_start = meta.ordinal;
        }
        self.recent.push_back(meta);
        while self.recent.len() > RECENT_ROWS_MAX {
            self.recent.pop_front();
        }
    }

    /// Ordinal of the newest row `agent` did not write (0: none).
    pub fn last_foreign_ordinal(&self, agent: &str) -> u64 {
        if self.tail > 0 && self.trailing_owner.as_deref() == Some(agent) {
            self.trailing_run_start - 1
        } else {
            self.tail
        }
    }

    pub fn row(&self, ordinal: u64) -> Option<&RowMeta> {
        let first = self.recent.front()?.ordinal;
        let index = ordinal.checked_sub(first)?;
        self.recent.get(usize::try_from(index).ok()?).filter(|r| r.ordinal == ordinal)
    }

    /// Rows after `cursor`, newest first, as far as the window reaches.
    pub fn newest_after(&self, cursor: u64) -> impl Iterator<Item = &RowMeta> {
        self.recent.iter().rev().take_while(move |r| r.ordinal > cursor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ordinal: u64, owner: Option<&str>) -> RowMeta {
        RowMeta {
            ordinal,
            seq: ordinal,
            at_ns: 0,
            ts: String::new(),
            ts_seconds: 0,
            user_id: String::new(),
            bot_id: String::new(),
            owner: owner.map(str::to_owned),
            row_bytes: 10,
            sender_bytes: 1,
            body_bytes: 1,
        }
    }

    #[test]
    fn last_foreign_follows_the_trailing_run() {
        let mut journal = SurfaceJournal::default();
        assert_eq!(journal.last_foreign_ordinal("a"), 0);
        journal.push(row(1, Some("a")));
        assert_eq!(journal.last_foreign_ordinal("a"), 0);
        assert_eq!(journal.last_foreign_ordinal("b"), 1);
        journal.push(row(2, None));
        journal.push(row(3, Some("a")));
        journal.push(row(4, Some("a")));
        assert_eq!(journal.last_foreign_ordinal("a"), 2);
        journal.push(row(5, Some("b")));
        assert_eq!(journal.last_foreign_ordinal("a"), 5);
        assert_eq!(journal.last_foreign_ordinal("b"), 4);
        for n in 6..200 {
            journal.push(row(n, None));
        }
        assert_eq!(journal.recent.len(), RECENT_ROWS_MAX);
        assert!(journal.row(5).is_none());
        assert_eq!(journal.row(199).map(|r| r.ordinal), Some(199));
    }
}
