//! A journal row as plain values: what the fold keeps of it ([`RowMeta`]) and its content as
//! read from the log ([`RowBody`]). Below the areas and the text writer, which both use them;
//! [`crate::journal`] re-exports them. The rendered size of a row for a reader
//! ([`RowMeta::bytes_for`]) sits with the writer in [`crate::text`].

use serde::{Deserialize, Serialize};

use crate::proto;
use crate::surface::Id;

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
    pub ts: Id,
    pub ts_seconds: i64,
    pub user_id: Id,
    pub bot_id: Id,
    /// The agent whose platform identity wrote it, classified when it was journaled.
    pub owner: Option<Id>,
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

/// A row's content borrowed from where it lies (the decoded event the fold is applying, or a
/// [`RowBody`]): what the fold sizes a new row from, without copying the event's text.
#[derive(Clone, Copy, Debug, Default)]
pub struct BodyRef<'a> {
    pub text: &'a str,
    pub user_name: &'a str,
    pub files: &'a [proto::SlackFile],
    pub previews: &'a [proto::LinkPreview],
}

impl<'a> BodyRef<'a> {
    /// The body of a journaled event (a Slack or chat observation, a Linear session event, or a
    /// confirmed own post), borrowed from it; `None` for any other event. The one mapping of
    /// events to bodies: the fold sizes a row from it when it journals the row (through the
    /// constructors below), and readers render the row from it ([`RowBody::from_envelope`]), so
    /// the stored sizes and the rendered row cannot disagree on what the body is.
    pub fn of(payload: &'a proto::envelope::Payload) -> Option<Self> {
        use proto::envelope::Payload;
        match payload {
            Payload::SlackMessage(m) => Some(BodyRef::slack(m)),
            Payload::ChatMessage(m) => Some(BodyRef::chat(m)),
            Payload::LinearSession(e) => Some(BodyRef::linear(e)),
            Payload::SendConfirmed(c) => Some(BodyRef::confirmed(c)),
            _ => None,
        }
    }

    pub fn slack(m: &'a proto::SlackMessageObserved) -> Self {
        BodyRef { text: &m.text, user_name: &m.user_name, files: &m.files, previews: &m.previews }
    }

    pub fn chat(m: &'a proto::ChatMessageObserved) -> Self {
        BodyRef { text: &m.text, user_name: &m.sender_name, files: &m.files, previews: &[] }
    }

    /// The prompt is the body of a Linear wake's trigger; the issue title stands where a sender's
    /// name would.
    pub fn linear(e: &'a proto::LinearSessionEvent) -> Self {
        BodyRef { text: &e.prompt_text, user_name: &e.issue_title, ..BodyRef::default() }
    }

    pub fn confirmed(c: &'a proto::SendConfirmed) -> Self {
        BodyRef { text: &c.text, files: &c.files, ..BodyRef::default() }
    }

    /// The body, owned.
    pub fn owned(self) -> RowBody {
        RowBody {
            text: self.text.to_owned(),
            user_name: self.user_name.to_owned(),
            files: self.files.to_vec(),
            previews: self.previews.to_vec(),
        }
    }
}

impl RowBody {
    /// The body, borrowed.
    pub fn as_ref(&self) -> BodyRef<'_> {
        BodyRef { text: &self.text, user_name: &self.user_name, files: &self.files, previews: &self.previews }
    }

    /// The body of a journaled event, owned (see [`BodyRef::of`]).
    pub fn from_envelope(envelope: &proto::Envelope) -> Option<RowBody> {
        BodyRef::of(envelope.payload.as_ref()?).map(BodyRef::owned)
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
