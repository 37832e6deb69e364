//! The event log: one totally ordered sequence of stored events, behind one trait with two real
//! backends — NATS JetStream (`jetstream`) and an embedded log on sled (`embedded`). Both pass one
//! conformance suite (`tests/it/conformance.rs`).
//!
//! Sequences start at 1 and are dense in the embedded log; JetStream sequences are dense too as
//! long as nothing is deleted. The timestamp is the log's own: JetStream's stored message time,
//! or the embedded writer's clock made monotonic. Folds use it; never a client's clock.

pub mod embedded;
pub mod jetstream;
mod window_ids;

use bytes::Bytes;
use futures::stream::BoxStream;

use crate::subject::Subjects;

/// One event to append. `msg_id` is fixed before the first attempt: retries must reuse it, since a
/// failed append may still have been stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppendRecord {
    /// Full subject, e.g. `anima.v1.surface.slack.T1.C1`, under the log's prefix. Built by the
    /// log's [`Subjects`].
    pub subject: String,
    /// Dedupe key (`Nats-Msg-Id`): an append with an id seen inside the dedupe window is a duplicate.
    pub msg_id: String,
    /// The encoded `anima.v1.Envelope`.
    pub payload: Bytes,
}

/// What an append did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AppendOutcome {
    /// Stored at `seq`.
    Appended { seq: u64 },
    /// The same `msg_id` was stored inside the dedupe window, at `seq`; nothing new was stored.
    Duplicate { seq: u64 },
}

impl AppendOutcome {
    /// The sequence of the stored event, new or earlier.
    pub fn seq(self) -> u64 {
        match self {
            AppendOutcome::Appended { seq } | AppendOutcome::Duplicate { seq } => seq,
        }
    }

    pub fn is_duplicate(self) -> bool {
        matches!(self, AppendOutcome::Duplicate { .. })
    }
}

/// A stored event as read back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRecord {
    pub seq: u64,
    /// A UTF-8 string sharing its bytes (async-nats's subject type): on the embedded log a
    /// slice of the stored entry the record was read from, on JetStream the received message's
    /// own subject, so reading a record copies no subject. Every event the fold applies is read
    /// back as a record, and a rebuild reads the whole log.
    pub subject: async_nats::Subject,
    /// The log's own time of the event, unix nanoseconds.
    pub timestamp_ns: i64,
    pub payload: Bytes,
}

/// A NATS-style subject filter over full subjects (prefix included): tokens separated by `.`,
/// `*` matches one token, a final `>` matches one or more. `None` in the APIs below means every
/// subject. Filters come from the engine itself (built with the log's [`Subjects`]); API clients
/// name surfaces and agents, never subjects.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubjectFilter(pub String);

impl SubjectFilter {
    /// Whether `subject` matches, with NATS semantics.
    pub fn matches(&self, subject: &str) -> bool {
        let mut pattern = self.0.split('.');
        let mut tokens = subject.split('.');
        loop {
            match (pattern.next(), tokens.next()) {
                (Some(">"), Some(_)) => return true,
                (Some("*"), Some(_)) => {}
                (Some(p), Some(t)) if p == t => {}
                (None, None) => return true,
                _ => return false,
            }
        }
    }

    /// Checks the filter's syntax: non-empty tokens without whitespace or control characters,
    /// `*` and `>` only as whole tokens, `>` only as the last one. Both backends refuse a
    /// malformed filter with [`LogError::Invalid`] instead of guessing what it meant.
    pub fn validate(&self) -> LogResult<()> {
        let tokens: Vec<&str> = self.0.split('.').collect();
        let last = tokens.len() - 1;
        for (index, token) in tokens.iter().enumerate() {
            let malformed = token.is_empty()
                || token.chars().any(|c| c.is_whitespace() || c.is_control())
                || (token.len() > 1 && token.contains(['*', '>']))
                || (*token == ">" && index != last);
            if malformed {
                return Err(LogError::Invalid(format!(
                    "subject filter {} is malformed",
                    crate::validate::echo(&self.0)
                )));
            }
        }
        Ok(())
    }
}

/// Errors of log operations. Each variant says what the caller should do.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The log cannot be reached, did not answer in time, or answered with an error that passes
    /// on retry (a cluster electing a leader, a first copy of the same msg id still
    /// replicating). Retry with the same `msg_id`; the append may or may not have been stored.
    /// Maps to `UNAVAILABLE`.
    #[error("event log unavailable: {0}")]
    Unavailable(String),
    /// The store is inconsistent or misconfigured (e.g. the stream exists with incompatible
    /// settings, a record does not decode, a malformed server list), or the server refused for
    /// good. Do not retry blindly; fail closed. Maps to `FAILED_PRECONDITION`.
    #[error("event log store error: {0}")]
    Store(String),
    /// The input cannot be stored (empty subject or msg id, subject outside the log's prefix,
    /// over the size bound). Fix the input.
    #[error("invalid append: {0}")]
    Invalid(String),
}

pub type LogResult<T> = Result<T, LogError>;

/// The event log contract. Implemented by [`embedded::EmbeddedLog`] and
/// [`jetstream::JetStreamLog`]; everything above the log is written against this trait only.
#[async_trait::async_trait]
pub trait EventLog: Send + Sync + 'static {
    /// A stable identity of this stream (name plus creation stamp). Checkpoints taken against
    /// another identity are discarded.
    fn identity(&self) -> String;

    /// The prefix and token encoding of this log's subjects: the configured prefix, and the
    /// encoding the log recorded when it was created. Every subject appended to this log, and
    /// every filter read from it, is built with these.
    fn subjects(&self) -> &Subjects;

    /// Appends one event; returns once it is durably stored (or known to be a duplicate).
    async fn append(&self, record: AppendRecord) -> LogResult<AppendOutcome>;

    /// Appends many, pipelined with a bounded window of acknowledgements in flight, polled
    /// together. Outcomes are in input order. On error, some earlier records may be stored:
    /// retrying the whole batch with the same `msg_id`s is safe inside the dedupe window.
    async fn append_batch(&self, records: Vec<AppendRecord>) -> LogResult<Vec<AppendOutcome>>;

    /// Stored events with `from_seq <= seq <= to_seq`, in order, filtered by subject. Ends at
    /// `to_seq` or at the last event stored when the call was made, whichever is lower.
    async fn read(
        &self,
        from_seq: u64,
        to_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>>;

    /// Like `read` from `from_seq`, then live: the stream never ends on its own.
    async fn follow(
        &self,
        from_seq: u64,
        filter: Option<SubjectFilter>,
    ) -> LogResult<BoxStream<'static, LogResult<StoredRecord>>>;

    /// One stored event, if there is one at `seq`.
    async fn get(&self, seq: u64) -> LogResult<Option<StoredRecord>>;

    /// The sequence of the newest stored event (0 when empty).
    async fn last_seq(&self) -> LogResult<u64>;
}

/// Largest payload either backend accepts, in bytes. A 160,000-byte Slack text plus envelope
/// fits well inside; JetStream's default max payload is 1 MiB.
pub const PAYLOAD_BYTES_MAX: usize = 900 * 1024;

/// Checks what both backends require of a record before storing it: among others, that its
/// subject lies under the log's prefix (`subjects`).
pub fn validate_record(record: &AppendRecord, subjects: &Subjects) -> LogResult<()> {
    if record.msg_id.is_empty() || record.msg_id.len() > 256 {
        return Err(LogError::Invalid("msg_id must be 1..=256 bytes".into()));
    }
    if record.msg_id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(LogError::Invalid("msg_id must not contain whitespace or control characters".into()));
    }
    if !subjects.owns(&record.subject) || crate::subject::check_subject(&record.subject).is_err() {
        return Err(LogError::Invalid(format!(
            "subject {} is not a valid subject under this log's prefix {}",
            crate::validate::echo(&record.subject),
            subjects.prefix()
        )));
    }
    if record.payload.len() > PAYLOAD_BYTES_MAX {
        return Err(LogError::Invalid(format!(
            "payload of {} bytes exceeds {PAYLOAD_BYTES_MAX}",
            record.payload.len()
        )));
    }
    Ok(())
}
